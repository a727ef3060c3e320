"""The logdiff CLI's prompt lengths (the CLI itself, run in a fresh process: tests/engine/test_logdiff_engine.py)."""


def test_prompt_lengths_span_1_to_200():
    from true_on_policy.cli.logdiff import prompt_lengths

    lengths = prompt_lengths(8)
    assert lengths[0] == 1 and lengths[-1] == 200 and len(set(lengths)) == 8
