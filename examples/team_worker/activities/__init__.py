"""The team's own activities (one of them becomes an agent's tool)."""
