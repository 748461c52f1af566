"""The local load board's lag: how far behind its predictions a worker's queue runs."""

from __future__ import annotations

import pytest

from router.load import LocalLoadBoard


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def lag(board: LocalLoadBoard, worker: str) -> float:
    return board.snapshot([worker])[0].lag_s


def test_lag_is_the_oldest_waiting_streams_delay_beyond_its_prediction() -> None:
    clock = Clock()
    board = LocalLoadBoard(clock=clock)
    first = board.acquire("w0", 0.1, modelled_s=0.5)
    clock.now += 1.0
    second = board.acquire("w0", 0.1, modelled_s=0.2)
    whole = board.acquire("w0", 0.1)  # a whole answer: its first byte comes after decode
    assert lag(board, "w0") == pytest.approx(0.5)  # first: 1.0 s waited, 0.5 s predicted
    clock.now += 3.0
    assert lag(board, "w0") == pytest.approx(3.5)
    assert lag(board, "w1") == 0.0
    board.first_byte(first)
    assert lag(board, "w0") == pytest.approx(2.8)  # now second, 3.0 s waited, 0.2 predicted
    board.release(second)  # ended without a first byte (failed): no longer waiting either
    assert lag(board, "w0") == 0.0  # the whole answer is not tracked
    for ticket in (first, whole):
        board.release(ticket)
    assert board.snapshot(["w0"])[0].inflight == 0


def test_no_lag_while_requests_are_answered_in_their_predicted_time() -> None:
    clock = Clock()
    board = LocalLoadBoard(clock=clock)
    ticket = board.acquire("w0", 0.1, modelled_s=2.0)
    clock.now += 1.5
    assert lag(board, "w0") == 0.0
    board.first_byte(ticket)
    board.forget("w0")
    assert lag(board, "w0") == 0.0
