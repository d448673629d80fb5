"""On-policy training data for an EAGLE-3-style draft: the target's own answers, built offline.

Issue 24, item 1. Prompts are made here, nothing downloaded, deterministic from a seed:

- Magpie (`magpie.py`): the target writes user queries from its chat template's user-turn prefix;
- template × topic (`prompts.py`, `templates.py`): topics from this machine's man pages, Debian
  package descriptions, the standard library's modules and `help()` topics, and English words;
- code tasks from standard-library signatures and docstrings, and raw code-completion prompts (no
  chat template, as the HumanEval workload sends);
- HumanEval and every prompt of `cluster/workloads.py` are held out (`heldout.py`): a prompt equal
  to, containing, or sharing an 8-word run with one never enters the data.

The target answers every prompt through its chat template (the default system prompt the template
adds; raw text for completions), greedy for a fraction of the prompts and at its usual sampling
(temperature 0.7, top-p 0.9) for the rest, up to 512 tokens, with vLLM's offline `vllm.LLM` when
it imports, else transformers' batched `generate` (`engines.py`).

Stored per sample (`shards.py`): the full token ids (prompt template + answer), the prompt length,
the source kind and pool, chat or raw, greedy or sampled, the sampling seed, how it finished and
the prompt text. Hidden states are NOT stored (about 3.4 KB a token for three 576-wide layers in
bf16, i.e. ~17 GB for 5 M tokens): the trainer recomputes the three layers' features and the
target's logits with one batched teacher-forced forward over the stored ids, which costs far less
than generating them did and always matches the target it trains against.

Shards of `--shard-size` samples are compressed `.npz` files written atomically and listed in
`manifest.json` (recipe, done shards, totals, runs), so a killed run resumes at the next undone
shard (`pipeline.py`). CLI: `python -m tools.draftdata generate|status` (`__main__.py`).

Reading the data back::

    from tools.draftdata.shards import Manifest, read_shard
    m = Manifest.load(out)
    for rec in m.shards:
        shard = read_shard(out / rec.file)
        for i in range(len(shard)):
            ids, p = shard.sample(i), int(shard.prompt_len[i])   # answer = ids[p:]
"""

import cluster  # noqa: F401,E402  (loopback-only defaults: vLLM and the hub report nothing)
