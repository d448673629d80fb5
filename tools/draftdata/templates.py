"""Prompt templates, per topic category; `{name}` is the topic, `{desc}` its one-line description.

Code templates take `{q}` (a qualified name, "os.path.join"), `{sig}` (its signature, may be
empty), `{short}` (the last part of the name), `{summary}` (its first docstring sentence) and
`{lang}` ("Python" or "C"). Completion templates take `{name}`, `{sig}`, `{doc}`, `{summary}`, `{module}`.
"""

from __future__ import annotations

GENERAL = [
    "Explain {name}.",
    "What is {name}?",
    "Write a short story about {name}.",
    "What are the pros and cons of {name}?",
    "Write a poem about {name}.",
    "Give me three interesting facts about {name}.",
    "Explain {name} to a five-year-old.",
    "What are common misconceptions about {name}?",
    "Write a haiku about {name}.",
    "How would you describe {name} to someone who has never heard of it?",
    "Write a short dialogue between two friends talking about {name}.",
    "What is the history of {name}?",
    "Give me a list of ideas related to {name}.",
    "Why does {name} matter?",
    "Write a product description for something called \"{name}\".",
    "Compose a limerick about {name}.",
    "What questions should I ask to learn more about {name}?",
    "Summarize what people usually mean by \"{name}\".",
    "Write a motivational paragraph that uses the word \"{name}\".",
    "Use the word \"{name}\" in five different sentences.",
    "What does the word \"{name}\" mean? Give synonyms and an example sentence.",
    "Write a short news headline and article about {name}.",
    "Tell me a joke about {name}.",
    "Write a tweet about {name}.",
    "Describe a day in the life of someone obsessed with {name}.",
    "What would the world be like without {name}?",
    "Give me a quiz with three questions about {name}.",
    "Write a letter to a friend about {name}.",
    "How can I teach a class about {name}?",
    "Create a short riddle whose answer is \"{name}\".",
    "Argue for and against {name} in two short paragraphs.",
    "Write the opening paragraph of a mystery novel involving {name}.",
]

COMMAND = [
    "How do I use the `{name}` command? It is described as: {desc}.",
    "Explain what the Linux command `{name}` does ({desc}) and give an example.",
    "What are the most useful options of `{name}`?",
    "Write a shell script that uses `{name}` to {desc}.",
    "I need to {desc}. Which command should I use and how?",
    "Give three practical examples of the `{name}` command.",
    "What is the difference between `{name}` and similar tools?",
    "Explain `{name}` to a beginner who is new to the Linux terminal.",
    "What could go wrong when using `{name}`, and how do I avoid it?",
    "Write a short tutorial on `{name}`: {desc}.",
]

FILE_FORMAT = [
    "What is the `{name}` file used for on Linux? ({desc})",
    "Explain the format of `{name}`: {desc}.",
    "Give an example `{name}` file and explain each line.",
    "How do I safely edit `{name}`?",
    "What are common mistakes when configuring `{name}`?",
]

CONCEPT = [
    "Explain {name} on Linux: {desc}.",
    "What is {name} ({desc})? Give an example.",
    "Write a beginner's guide to {name}.",
    "Why is {name} important? It is described as: {desc}.",
    "Summarize the key ideas of {name} in a few bullet points.",
]

PACKAGE = [
    "What is the Debian package `{name}` ({desc}) and when would I install it?",
    "Explain what {name} is: {desc}.",
    "How do I get started with {name}?",
    "What are alternatives to {name} ({desc})?",
    "Write a short review of {name}: {desc}.",
]

PYMODULE = [
    "What is Python's `{name}` module for?",
    "Give an example of using the `{name}` module. Its documentation says: {desc}",
    "Write a short tutorial on Python's `{name}` module.",
    "What are the most useful functions in the `{name}` module?",
    "When should I use `{name}` instead of a third-party library?",
    "Explain the `{name}` module to a beginner.",
    "Write a small script that demonstrates the `{name}` module.",
    "What are common pitfalls when using `{name}` in Python?",
    "Compare the `{name}` module with an alternative approach in Python.",
    "Show me three idiomatic uses of `{name}`.",
]

PYTOPIC = [
    "Explain {name} in Python with an example.",
    "How does {name} work in Python?",
    "What are common mistakes with {name} in Python?",
    "Write a short quiz about {name} in Python.",
    "Explain {name} in Python to someone who knows JavaScript.",
    "Give three examples that illustrate {name} in Python.",
]

PYKEYWORD = [
    "What does the `{name}` keyword do in Python?",
    "Give an example of the `{name}` keyword in Python.",
    "When should I use `{name}` in Python?",
    "Explain `{name}` in Python to a beginner.",
]

BY_CATEGORY = {
    "word": GENERAL, "command": COMMAND, "file format": FILE_FORMAT, "concept": CONCEPT,
    "package": PACKAGE, "pymodule": PYMODULE, "pytopic": PYTOPIC, "pykeyword": PYKEYWORD,
}

CODE = [
    "Write a {lang} function that does the following: {summary}",
    "Explain what `{q}` does with an example.",
    "Show how to use `{q}{sig}` in a short {lang} program.",
    "What arguments does `{q}` take, and what does it return?",
    "Implement your own version of `{q}` in {lang}. It should: {summary}",
    "Write unit tests for `{q}`, which is documented as: {summary}",
    "What are common mistakes when calling `{q}`?",
    "Write a {lang} snippet that uses `{q}` and explain it line by line.",
    "I read that `{q}` does this: \"{summary}\" What does that mean in practice?",
    "Write a {lang} function called `{short}` that behaves like `{q}`: {summary} Include a docstring.",
    "Give a real-world use case for `{q}` and show the code.",
    "Compare `{q}` with another way of achieving the same thing in {lang}.",
    "Refactor a small program so that it uses `{q}`, and explain the benefit.",
    "How would you debug a problem where `{q}` does not behave as expected?",
]

# completion prompts (no chat template): the target continues the code, as on HumanEval
COMPLETION = [
    'def {name}{sig}:\n    """{doc}"""\n',
    'import {module}\n\n\ndef {name}{sig}:\n    """{summary}\n\n    Use only the standard library.\n    """\n',
]
