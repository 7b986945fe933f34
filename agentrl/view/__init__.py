"""`agentrl view`: a local web page over a run or evaluation folder (data.py reads, server.py serves, static/ draws)."""

from agentrl.view.data import Filters, Folder
from agentrl.view.server import create_app

__all__ = ["Filters", "Folder", "create_app"]
