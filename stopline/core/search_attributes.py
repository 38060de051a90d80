"""stopline's custom search attributes: typed keys and their registration.

Teams already on Temporal find tasks with visibility queries, e.g.
``temporal workflow list --query 'StoplineRefused = true'``. The workflow
upserts these keys (``workflow.upsert_search_attributes``) as a task moves;
the server must know them first, or the upsert fails the workflow task:

- embedded dev server: ``temporal server start-dev --search-attribute
  KEY=TYPE`` (:func:`dev_server_flags`, used by ``stopline.worker.runtime``);
- test dev server: ``WorkflowEnvironment.start_local(search_attributes=ALL)``;
- a real cluster: ``stopline search-attributes register`` (:func:`register`,
  idempotent), or ``temporal operator search-attribute create`` (README).

This module is imported by workflow code inside the sandbox, so it does no
I/O at import and imports only ``temporalio.common`` at module level; the
operator-service protobufs are imported inside :func:`register`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from temporalio.common import (
    SearchAttributeIndexedValueType,
    SearchAttributeKey,
    SearchAttributeUpdate,
)

from stopline.core.errors import StoplineError

if TYPE_CHECKING:
    from temporalio.client import Client

#: The task's state as :class:`stopline.core.contracts.TaskStatus` names it
#: (``running``, ``waiting``, ``waiting_for_host``, ``completed``, ``failed``,
#: ``stopped``).
STATUS: SearchAttributeKey[str] = SearchAttributeKey.for_keyword("StoplineStatus")
#: ``True`` once a provider refused (DESIGN §4): the task stopped on it.
REFUSED: SearchAttributeKey[bool] = SearchAttributeKey.for_bool("StoplineRefused")
#: What kind of workflow this is: ``task`` (AgentTask) or ``chat``.
KIND: SearchAttributeKey[str] = SearchAttributeKey.for_keyword("StoplineKind")
#: The ``provider:model`` reference the task samples from.
MODEL: SearchAttributeKey[str] = SearchAttributeKey.for_keyword("StoplineModel")

#: The id of the host the task holds (DESIGN §7; ``stopline hosts``); empty
#: while it waits for one.
HOST: SearchAttributeKey[str] = SearchAttributeKey.for_keyword("StoplineHost")

#: Every stopline search attribute, in registration order.
ALL: tuple[SearchAttributeKey, ...] = (STATUS, REFUSED, KIND, MODEL, HOST)


class SearchAttributeTypeConflict(StoplineError, RuntimeError):
    """A stopline attribute name is registered with another type.

    Not fixable by retrying: the attribute must be removed (or the
    namespace's other user renamed) by an operator.
    """


def type_name(key: SearchAttributeKey) -> str:
    """The server's name of a key's type (``Keyword``, ``Bool``, ...).

    It is the spelling ``temporal server start-dev --search-attribute`` and
    ``temporal operator search-attribute create --type`` accept.
    """
    T = SearchAttributeIndexedValueType
    return {
        T.TEXT: "Text",
        T.KEYWORD: "Keyword",
        T.INT: "Int",
        T.DOUBLE: "Double",
        T.BOOL: "Bool",
        T.DATETIME: "Datetime",
        T.KEYWORD_LIST: "KeywordList",
    }[key.indexed_value_type]


def dev_server_flags() -> list[str]:
    """``--search-attribute KEY=TYPE`` flags for ``temporal server start-dev``.

    Re-registering an attribute that an existing SQLite file already has is
    accepted by the dev server, so the flags are passed on every start.
    """
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}={type_name(key)}"]
    return flags


def cli_commands(namespace: str = "default") -> list[str]:
    """The equivalent ``temporal operator search-attribute create`` commands.

    Args:
        namespace: Target namespace.

    Returns:
        One shell command per attribute (for the README and for operators
        who register attributes by hand).
    """
    return [
        f"temporal operator search-attribute create --namespace {namespace} "
        f"--name {key.name} --type {type_name(key)}"
        for key in ALL
    ]


def literal(value: str) -> str:
    """``value`` as a string literal in a visibility query (quotes escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def updates(
    *,
    status: str | None = None,
    refused: bool | None = None,
    kind: Literal["task", "chat"] | None = None,
    model: str | None = None,
    host: str | None = None,
) -> list[SearchAttributeUpdate]:
    """Search-attribute updates for the given values (``None``: unchanged).

    For workflow code: ``workflow.upsert_search_attributes(updates(...))``.
    Pure (no workflow API calls) so it is usable and testable anywhere.
    """
    out: list[SearchAttributeUpdate] = []
    if status is not None:
        out.append(STATUS.value_set(status))
    if refused is not None:
        out.append(REFUSED.value_set(refused))
    if kind is not None:
        out.append(KIND.value_set(kind))
    if model is not None:
        out.append(MODEL.value_set(model))
    if host is not None:
        out.append(HOST.value_set(host))
    return out


async def register(client: Client, namespace: str | None = None) -> dict[str, str]:
    """Register every stopline search attribute on a cluster (idempotent).

    Attributes the namespace already has with the right type are left as
    they are; one that exists with another type is an error (a query on it
    would silently mean something else).

    Args:
        client: A connected client (its operator service is used).
        namespace: Target namespace (default: the client's).

    Returns:
        ``{name: "created" | "exists"}`` for each attribute.

    Raises:
        SearchAttributeTypeConflict: If an attribute exists with a
            different type.
        temporalio.service.RPCError: If the server refuses the request (e.g.
            missing permission on Temporal Cloud, where attributes are added
            with ``tcld`` or the Cloud UI instead).
    """
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import (
        AddSearchAttributesRequest,
        ListSearchAttributesRequest,
    )
    from temporalio.service import RPCError, RPCStatusCode

    ns = namespace or client.namespace
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=ns)
    )
    existing = dict(listed.custom_attributes)
    out: dict[str, str] = {}
    missing = {}
    for key in ALL:
        if key.name in existing:
            if existing[key.name] != int(key.indexed_value_type):
                have = IndexedValueType.Name(existing[key.name])
                raise SearchAttributeTypeConflict(
                    f"search attribute {key.name} exists in namespace {ns} as {have}, "
                    f"stopline needs {type_name(key)}"
                )
            out[key.name] = "exists"
        else:
            missing[key.name] = IndexedValueType.ValueType(int(key.indexed_value_type))
    if missing:
        try:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(namespace=ns, search_attributes=missing)
            )
        except RPCError as err:
            # A concurrent registration won the race: same outcome.
            if err.status != RPCStatusCode.ALREADY_EXISTS:
                raise
        out.update({name: "created" for name in missing})
    return out
