"""The load test's users and their memory facts, without importing Locust (which monkey-patches
the standard library with gevent), so benchmark scripts can seed the same users first."""

from __future__ import annotations


def user_pool(size: int) -> list[str]:
    """The user ids requests are drawn from."""
    if size < 1:
        raise ValueError(f"the user pool needs at least one user, got {size}")
    return [f"loadtest-user-{index:04d}" for index in range(size)]


FACT_TEMPLATES: tuple[str, ...] = (
    "{user} has a dog called Biscuit.",
    "{user} is vegetarian.",
    "{user} lives in a flat in Leeds.",
    "{user} works night shifts as a nurse.",
    "{user} is learning to play the cello.",
    "{user} is allergic to peanuts.",
    "{user} runs 5 km every Sunday.",
    "{user} is saving for a trip to Japan.",
)


def memory_facts(user: str, count: int) -> list[str]:
    """The facts a load-test user's memory is seeded with (numbered beyond the templates)."""
    return [FACT_TEMPLATES[i % len(FACT_TEMPLATES)].format(user=user) + (f" (note {i})" if i >= len(FACT_TEMPLATES) else "") for i in range(count)]
