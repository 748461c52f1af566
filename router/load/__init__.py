"""Per-worker load as the router sees it: `board` (the interface and the in-process board)
and `redis` (the board shared by router replicas through Redis)."""

from router.load.board import DEFAULT_RECENT_HALF_LIFE_S, LoadBoard, LocalLoadBoard, Ticket

__all__ = ["DEFAULT_RECENT_HALF_LIFE_S", "LoadBoard", "LocalLoadBoard", "Ticket"]
