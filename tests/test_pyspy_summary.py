"""tools.pyspy_summary: shares over the main thread's stacks only."""

from tools.pyspy_summary import summarise

RAW = [
    "<module> (<string>:1);spawn_main (spawn.py:1);execute_model (r.py:1);LlamaModel.forward (l.py:2);mm (x:1) 6",
    "<module> (<string>:1);spawn_main (spawn.py:1);execute_model (r.py:1);RejectionSampler.forward (s.py:3) 2",
    "<module> (<string>:1);spawn_main (spawn.py:1);dequeue (q.py:9) 2",
    "Thread._bootstrap (threading.py:1);Condition.wait (threading.py:2) 90",
]


def test_shares_count_only_the_main_threads_stacks():
    out = summarise(RAW, "spawn_main", ("execute_model", "LlamaModel.forward", "RejectionSampler", "TandemProposer"))
    assert out["samples"] == 10
    assert out["keys"] == {"execute_model": 0.8, "LlamaModel.forward": 0.6, "RejectionSampler": 0.2, "TandemProposer": 0.0}
    assert out["leaves"][0] == ("mm", 0.6)


def test_without_a_root_every_stack_counts():
    out = summarise(RAW, None, ("execute_model",))
    assert out["samples"] == 100 and out["keys"]["execute_model"] == 0.08
    assert out["leaves"][0] == ("Condition.wait", 0.9)
