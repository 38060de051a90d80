"""The team's own workflows (a package named ``workflows``, like most
Temporal projects have: stopline installs nothing under that name)."""
