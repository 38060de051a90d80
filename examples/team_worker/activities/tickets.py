"""A ticket system the team already has; ``lookup_ticket`` is an ordinary
Temporal activity that stopline offers to the model as a tool."""

from __future__ import annotations

from pydantic import BaseModel, Field
from temporalio import activity
from temporalio.exceptions import ApplicationError

#: Stands in for the team's ticket database.
TICKETS = {
    "T-42": {"title": "Printer on fire", "status": "open", "owner": "facilities"},
    "T-7": {"title": "VPN drops every hour", "status": "in progress", "owner": "netops"},
}


class TicketQuery(BaseModel):
    """What the model passes to ``lookup_ticket``."""

    ticket_id: str = Field(description="The ticket id, e.g. T-42.")


class Ticket(BaseModel):
    """What ``lookup_ticket`` returns (the model reads it as JSON)."""

    ticket_id: str
    title: str
    status: str
    owner: str


@activity.defn(name="team.lookup_ticket")
async def lookup_ticket(query: TicketQuery) -> Ticket:
    """Look up a support ticket by id: its title, status and owner.

    An unknown id raises; stopline hands the error to the model as a failed
    tool result and the task goes on.
    """
    found = TICKETS.get(query.ticket_id)
    if found is None:
        raise ApplicationError(f"no ticket {query.ticket_id!r}", type="TicketNotFound", non_retryable=True)
    return Ticket(ticket_id=query.ticket_id, **found)
