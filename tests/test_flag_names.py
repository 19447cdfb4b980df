"""Engine-setting errors of the command line name the flags the user typed
(jaxinfer.cli.flag_names):
checked against the argparse parser itself (every mapped argument is a flag with that dest, and
a rewritten ``--flag value`` parses back to the value) and end to end through generate."""

import pytest

from jaxinfer.cli import main as cli
from jaxinfer.cli.flag_names import FLAG_ARGS, as_flags
from jaxinfer.cli.llm_from_args import llm_kwargs


def _generate_actions():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return {opt: a for a in sub.choices["generate"]._actions for opt in a.option_strings}


def test_every_mapped_argument_is_the_flag_of_that_dest():
    actions = _generate_actions()
    args = cli.build_parser().parse_args(
        ["generate", "--model", "m", "--prompts", "p", "--out", "o"]
    )
    assert set(FLAG_ARGS) <= set(llm_kwargs(args))  # LLM arguments the command line sets
    for name in FLAG_ARGS:
        msg = as_flags(f"{name}=7 is wrong")
        opt = msg.split()[0]
        assert opt in actions and actions[opt].dest == name, (name, msg)


@pytest.mark.parametrize(
    "message, flags",
    [
        (
            "max_num_batched_tokens=4 must be >= max_num_seqs=8 (every running sequence decodes)",
            {"max_num_batched_tokens": 4, "max_num_seqs": 8},
        ),
        ("attn_impl='pallas_tpu' cannot run on jax backend 'cpu'", {"attn_impl": "pallas_tpu"}),
        (
            "batch_invariant=True is not supported with speculative decoding (speculative='ngram')",
            {"batch_invariant": True, "speculative": "ngram"},
        ),
    ],
)
def test_rewritten_flags_parse_back_to_the_values(message, flags):
    actions = _generate_actions()
    words = as_flags(message).replace("(", " ").replace(")", " ").split()
    argv = []
    for i, w in enumerate(words):
        if w in actions:  # a flag, with its value when it takes one
            argv += [w] if actions[w].nargs == 0 else [w, words[i + 1]]
    args = cli.build_parser().parse_args(
        ["generate", "--model", "m", "--prompts", "p", "--out", "o", *argv]
    )
    assert {k: getattr(args, k) for k in flags} == flags
    assert not any(f"{name}=" in as_flags(message) for name in flags)


def test_prose_paths_and_unmapped_names_are_left_alone():
    msg = (
        "cannot read /m/draft_model/config.json: the tokenizer seed; kv_page_major=True; "
        "async_scheduling=False; no file /m/kv_pages"
    )
    assert as_flags(msg) == msg


def test_generate_error_names_the_flag(stories_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    base = [
        "generate",
        "--model",
        str(stories_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--no-progress",
    ]
    assert cli.main([*base, "--max-model-len", "0"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "jaxinfer: error: invalid engine setting: --max-model-len 0 is out of range"
    ), err
    assert cli.main([*base, "--kv-pages", "3"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "Raise --kv-pages or lower --max-model-len." in err and "_" not in err.split(": ", 2)[2]
