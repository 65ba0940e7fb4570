"""omniloop.testing.once_per_arguments: a fixture's builder runs once per argument set."""

from __future__ import annotations

from omniloop.testing import once_per_arguments


def test_once_per_argument_set_with_defaults_applied() -> None:
    calls: list[tuple[str, int]] = []

    @once_per_arguments
    def get(variant: str = "dev", size: int = 1) -> tuple[str, int]:
        calls.append((variant, size))
        return variant, size

    assert get() == get("dev") == get(variant="dev", size=1) == ("dev", 1)
    assert get("schnell") == ("schnell", 1) and get("schnell", 2) == ("schnell", 2)
    assert calls == [("dev", 1), ("schnell", 1), ("schnell", 2)]
