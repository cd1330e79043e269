"""SessionStore: the held prefix plus what is sent; 409 for what it does not hold; bounded by count and age."""

from __future__ import annotations

import pytest

from edgecloud.errors import SessionExpiredError
from edgecloud.runtime.completions import SessionRef
from edgecloud.serving.sessions import SessionStore


def test_a_round_continues_the_prefix_it_names() -> None:
    store = SessionStore()
    assert store.resolve(SessionRef(id="a"), [1, 2, 3]) == [1, 2, 3]  # base 0: the whole context
    store.hold("a", [1, 2, 3, 4, 5])
    assert store.resolve(SessionRef(id="a", base=3), [9]) == [1, 2, 3, 9]  # the rejected 4, 5 are dropped
    with pytest.raises(SessionExpiredError) as info:
        store.resolve(SessionRef(id="a", base=6), [9])  # more than it holds
    assert info.value.param == "session" and info.value.status_code == 409


def test_sessions_are_bounded_by_count_and_idle_time() -> None:
    now = [0.0]
    store = SessionStore(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.hold(name, [1, 2])
    assert len(store) == 2
    with pytest.raises(SessionExpiredError):
        store.resolve(SessionRef(id="a", base=1), [3])  # the least recently used went first
    now[0] = 11.0
    with pytest.raises(SessionExpiredError):
        store.resolve(SessionRef(id="c", base=1), [3])  # idle past its time
    assert len(store) == 0


@pytest.mark.parametrize("bad", [{"id": ""}, {"id": "a/b"}, {"id": "x" * 129}, {"id": "a", "base": -1}])
def test_a_session_reference_is_checked(bad: dict[str, object]) -> None:
    from edgecloud.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        SessionRef(**bad)


def test_one_sessions_requests_take_turns_in_arrival_order_and_others_do_not_wait() -> None:
    import asyncio

    store = SessionStore()
    order: list[str] = []

    async def check(name: str, session: str, gate: asyncio.Event | None = None) -> None:
        async with store.turn(session):
            order.append(f"{name} starts")
            if gate is not None:
                await gate.wait()
            order.append(f"{name} ends")

    async def main() -> None:
        order.clear()
        gate = asyncio.Event()
        first = asyncio.create_task(check("first", "a", gate))
        await asyncio.sleep(0)
        second = asyncio.create_task(check("second", "a"))
        other = asyncio.create_task(check("other", "b"))
        await asyncio.sleep(0.01)
        assert order == ["first starts", "other starts", "other ends"]  # another session does not wait
        gate.set()
        await asyncio.gather(first, second, other)

    asyncio.run(main())
    assert order[3:] == ["first ends", "second starts", "second ends"]  # the later one waited its turn
    asyncio.run(main())  # and the session's turn is free again afterwards
