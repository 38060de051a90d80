"""The one exception root of stopline, and the tree under it.

Every exception stopline raises on purpose derives from :class:`StoplineError`,
so a team embedding stopline can catch "anything stopline refused to do" in
one clause. Each class lives where its concern lives and is listed here::

    StoplineError
    ├── UsageError                      stopline.cli: a command-line or set-up problem (exit 2)
    ├── EmbeddedServerError             stopline.worker.runtime: the embedded server or worker did not come up
    ├── ConfigError                     bad settings: a malformed key or address
    │   └── CodecKeyError               stopline.worker.codec
    ├── ConversationInvalid             stopline.core.policies: a transcript a provider would reject
    ├── ProviderError                   stopline.activities.providers.base: a model call failed
    ├── LedgerCorrupt                   stopline.activities.ledger: the ledger file has a gap
    ├── ToolError                       a tool call could not be made (becomes ok=False, DESIGN §2)
    │   ├── OutsideWorkspace            stopline.activities.tools.workspace
    │   ├── SymlinkRefused              stopline.activities.tools.beneath: a file tool met a link
    │   └── PatchError                  stopline.activities.tools.patch (and its subclasses)
    ├── TaskNotContinuable              stopline.activities.tasks: refused, ended or unknown task
    ├── UpdateNotAnswered               stopline.activities.tasks: no worker took an Update up, or finished it, in time
    ├── SearchAttributeTypeConflict     stopline.core.search_attributes
    ├── HostError                       placement: this process cannot serve as a host
    │   └── HostInUse                   stopline.activities.host: another worker holds this home
    └── FatalToolError                  raised by a team's tool activity: stop the turn, fail
                                        the task (also a Temporal ApplicationError)

Errors that cross the workflow boundary do so as Temporal
``ApplicationError`` with a stable ``type`` string (e.g. ``ProviderError``,
``LedgerCorrupt``), never as these classes: a workflow sees failures, not
Python exceptions.

This module is part of the pure core: no I/O, importable in the sandbox.
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError


class StoplineError(Exception):
    """Root of every exception stopline raises on purpose."""


class ConfigError(StoplineError, ValueError):
    """A setting is malformed (a key, an address, a bound)."""


class ToolError(StoplineError, ValueError):
    """A tool call could not be made; the tool boundary turns it into
    ``RespondToModel(ok=False)`` (DESIGN §2), never a turn failure."""


class HostError(StoplineError):
    """This process cannot serve as a stopline host (DESIGN §7)."""


class FatalToolError(StoplineError, ApplicationError):
    """Raise from one of your tool activities to stop the turn and fail the task.

    DESIGN §2's ``Fatal``: only for an engine that is broken (a response in a
    shape it cannot handle, a join that failed) — never for a call that did
    not work, which is a tool result the model reads (raise anything else,
    or return a value saying so). Crosses Temporal as a non-retryable
    ``ApplicationError`` of type ``StoplineFatalToolError``
    (:data:`stopline.core.contracts.FATAL_TOOL_ERROR`).

    Args:
        reason: Why the task cannot go on; it becomes the task's reason.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason, type="StoplineFatalToolError", non_retryable=True)
        self.reason = reason


__all__ = ["ConfigError", "FatalToolError", "HostError", "StoplineError", "ToolError"]
