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


QUESTION_TEMPLATES: tuple[str, ...] = (
    "What should I know about {topic}?",
    "Give me one tip about {topic} that fits my life.",
    "How could {topic} fit into my week?",
    "Explain {topic} in two sentences.",
    "What is a common mistake with {topic}?",
    "Suggest a first step towards {topic}.",
    "Is {topic} a good idea for me?",
    "What would a friend say about {topic}?",
)
TOPICS: tuple[str, ...] = (
    "cooking a quick dinner", "sleeping better", "training a dog", "learning an instrument", "saving money",
    "planning a trip to Japan", "running a 10 km race", "working night shifts", "food allergies", "living in Leeds",
    "reading more books", "drinking less coffee", "writing a haiku", "learning Japanese", "growing herbs at home",
    "fixing a bike", "meditation", "making new friends", "taking better photos", "keeping a journal",
    "baking bread", "swimming", "moving flat", "learning to code", "volunteering",
    "hiking in the rain", "painting with watercolours", "playing chess", "eating more vegetables", "stretching after a run",
    "visiting a museum", "cleaning the kitchen", "buying a used car", "a birthday party", "gardening in winter",
    "studying for an exam", "caring for a cat", "a long train journey", "camping", "budgeting for the holidays",
    "public speaking", "cycling to work", "reducing screen time", "a job interview", "learning to dance",
    "knitting a scarf", "a rainy weekend", "calling my parents more", "going to bed earlier", "a picnic",
)


def varied_questions() -> list[str]:
    """400 different questions (8 forms x 50 topics): a user rarely asks one twice, so vLLM's
    prefix cache cannot stand in for memory the way it does when the few built-in questions repeat."""
    return [template.format(topic=topic) for topic in TOPICS for template in QUESTION_TEMPLATES]
