"""The ``kvcake`` command line, on a tiny random Llama saved with a word-level tokenizer.

A few runs go through a real subprocess (``python -m kvcake.cli``: exit codes, stdout/stderr,
no traceback); the rest call ``main(argv)`` in-process, which is the same code and much faster.
"""

import io
import random
import subprocess
import sys
import types

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvcake import cli

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|end|>", "<|assistant|>"]
WORDS = [f"w{i}" for i in range(128 - len(SPECIALS))]
TEMPLATE = (
    "{% for m in messages %}<|user|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SMALL = ["--budget", "24", "--window", "8", "--max-new-tokens", "6"]


@pytest.fixture(scope="session")
def tiny_dir(make_tiny_llama, tmp_path_factory):
    """A folder ``load_model`` reads: the tiny Llama, a word-level tokenizer with a chat
    template, and a 150-word document ``doc.txt``."""
    folder = tmp_path_factory.mktemp("tiny-model")
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIALS[4:],
    )  # fmt: skip
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    make_tiny_llama().save_pretrained(folder)
    rng = random.Random(0)
    (folder / "doc.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(150)))
    return folder


def start(args, stdin=""):
    """Start ``python -m kvcake.cli ARGS``; ``finish`` waits for it -> (code, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcake.cli", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    return proc, stdin


def finish(started):
    proc, stdin = started
    out, err = proc.communicate(stdin, timeout=300)
    return proc.returncode, out, err


def call(capsys, monkeypatch, args, stdin=""):
    """``main(ARGS)`` in-process -> (code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def model_args(folder):
    return ["--model", str(folder)]


def test_end_to_end_in_subprocesses(tiny_dir, tmp_path, capsys, monkeypatch):
    """The real entry point: answer two questions from a saved context; refuse a bad method."""
    kvc = str(tmp_path / "doc.kvc")
    save = [
        "save",
        *model_args(tiny_dir),
        "--context-file",
        str(tiny_dir / "doc.txt"),
        "--out",
        kvc,
        *SMALL[:4],
    ]
    assert call(capsys, monkeypatch, save)[0] == 0
    # both start at once: each spends seconds importing torch and transformers
    chat = start(["chat", "--load", kvc, "--max-new-tokens", "6"], stdin="w5 w6\nw7 w8\n\nw9\n")
    bad = start(["generate", *model_args(tiny_dir), "--prompt", "hi", "--method", "nope"])
    code, out, err = finish(chat)
    assert code == 0, err
    assert len(out.splitlines()) == 3, "piped input: the blank line is skipped, every question answered"
    assert "context: cake kept 192 of" in err and "Traceback" not in err
    code, out, err = finish(bad)
    assert code == 2 and out == ""
    assert err.startswith("kvcake: error: unknown method 'nope'") and err.count("\n") == 1
    assert "Traceback" not in err


class _AlwaysWarned(set):
    def __contains__(self, item) -> bool:
        return True


def test_generate_question_aware(tiny_dir, capsys, monkeypatch):
    from kvcake import temperatures

    # the tiny model has no calibration: its once-per-process warning was given by an earlier test
    # of a whole run; mark it given so this test reads the same alone and in the suite
    monkeypatch.setattr(temperatures, "_warned", _AlwaysWarned())
    code, out, err = call(capsys, monkeypatch, ["generate", *model_args(tiny_dir), "--prompt", "w1 w2 " * 60,
                                                *SMALL])  # fmt: skip
    assert code == 0, err
    assert len(out.split()) == 6 and set(out.split()) <= set(WORDS)
    assert err.count("\n") == 1  # the summary line
    assert (
        "cache: cake kept" in err and "KV entries" in err and "prefill 123 tokens" in err and "tok/s" in err
    )


def test_beam_search_from_the_command_line(tiny_dir, capsys, monkeypatch):
    """--num-beams prints the answer once found (transformers streams no beam search): the whole
    prompt kept, the stock beams' answer; a compressed document answers in generate and chat."""
    import torch

    from kvcake import load_model
    from kvcake.cli.common import _prompt_ids, _use_chat

    prompt = "w1 w2 w3 " * 30
    code, out, err = call(capsys, monkeypatch, ["generate", *model_args(tiny_dir), "--prompt", prompt, "--method",
                                                "full", "--num-beams", "3", "--max-new-tokens", "6"])  # fmt: skip
    assert code == 0, err
    model, tokenizer = load_model(str(tiny_dir))
    ids = _prompt_ids(tokenizer, prompt, _use_chat(tokenizer, None))
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, num_beams=3,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert out.strip() == tokenizer.decode(stock[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert "answer (beam search)" in err and "first token" not in err
    doc = ["--context-file", str(tiny_dir / "doc.txt"), *model_args(tiny_dir), *SMALL, "--num-beams", "2"]
    code, out, err = call(capsys, monkeypatch, ["generate", *doc, "--question", "w1 w2"])
    assert code == 0 and out.strip() and set(out.split()) <= set(WORDS), err
    code, chat, err = call(capsys, monkeypatch, ["chat", *doc], stdin="w1 w2\nw1 w2\n")
    assert code == 0 and chat.splitlines() == [out.strip()] * 2, err


def test_help_lists_every_command_with_examples(capsys, monkeypatch):
    code, out, _ = call(capsys, monkeypatch, ["--help"])
    assert code == 0
    for name, command in cli.COMMANDS.items():
        assert f"    {name}" in out and command.examples[0] in out
    assert "examples:" in out
    for name in cli.COMMANDS:
        code, out, _ = call(capsys, monkeypatch, [name, "--help"])
        assert code == 0 and ("--model" in out) == (name != "methods")  # methods runs no model


@pytest.mark.parametrize("command", [["eval", "--methods", "snapkv"], ["bench", "memory"], ["calibrate"]])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_threads_must_be_positive(capsys, monkeypatch, command, value):
    """torch refuses 0 and negative thread counts with a RuntimeError traceback: the option refuses them first."""
    code, _, err = call(capsys, monkeypatch, [*command, "--threads", value])
    assert code == 2 and f"argument --threads: expected a positive number of threads, got '{value}'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--samples", "0"], "samples must be an int >= 1, got 0"),
        (["--grid", "1"], "grid must be an int >= 2, got 1"),
        (["--length", "40"], "length must be an int >= 65, got 40"),
        (["--indicators", "avg4"], "odd kernel"),
        (["--ratios", "", "--budgets", ""], "give at least one ratio or budget"),
        # each of these ran every full forward first (a ratio below the window: minutes on SmolLM2)
        (
            ["--ratios", "0.01"],
            "--ratios 0.01 keeps 20 entries of a 2048-token calibration prompt, fewer than",
        ),
        (["--ratios", "1"], "--ratios 1.0 keeps every token of a 2048-token calibration prompt"),
        (["--budgets", "16"], "the window 32 is larger than --budgets 16"),
        (["--budgets", "4096"], "--budgets 4096 keeps every token"),
    ],
)
def test_calibrate_checks_its_settings_before_loading_the_model(capsys, monkeypatch, args, message):
    """A model's load took 20 s before ``--samples 0`` was refused."""
    import kvcake

    monkeypatch.setattr(kvcake, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = call(capsys, monkeypatch, ["calibrate", *args])
    assert code == 2 and message in err, err


def test_methods_lists_every_preset(capsys, monkeypatch):
    from kvcake.method import PRESETS

    code, out, _ = call(capsys, monkeypatch, ["methods"])
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[: len(PRESETS)]] == list(PRESETS)
    assert "tau1=auto" in lines[list(PRESETS).index("cake")]
    assert "kvcake calibrate" in out and "fallback" in out  # where 'auto' temperatures come from
    code, _, err = call(capsys, monkeypatch, ["methods", "--model", "gemma3-270m"])
    assert code == 2 and "unrecognized arguments: --model" in err  # it runs no model (was silently ignored)


def test_methods_loads_no_model_code():
    """``kvcake methods`` lists presets and the shipped calibrations (read by model fingerprint,
    ``kvcake.fingerprints``): transformers' configs, never its modelling code, which took about 3 s
    of a 7 s command when the calibrations were read through ``kvcake.models``."""
    code = (
        "import sys; from kvcake.cli import main; main(['methods']); "
        "print('transformers.modeling_utils' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "cake" in out and out.splitlines()[-1] == "False"


def test_chat_answers_equal_fresh_contexts(tiny_dir, capsys, monkeypatch):
    """Each question is answered from its own fork: asking two in a row gives the answers each
    one gets on a freshly compressed context."""
    base = [*model_args(tiny_dir), "--context-file", str(tiny_dir / "doc.txt"), *SMALL]
    questions = ["w5 w6 w7", "w40 w41"]
    code, out, err = call(capsys, monkeypatch, ["chat", *base], stdin="\n".join(questions) + "\n")
    assert code == 0, err
    chat_answers = out.splitlines()
    fresh = []
    for q in questions:
        code, out, err = call(capsys, monkeypatch, ["generate", *base, "--question", q])
        assert code == 0, err
        fresh.append(out.strip())
        assert "context: cake kept 192 of" in err  # 24 per layer x 4 layers x 2 KV heads
    assert chat_answers == fresh
    assert all(answer.split() and set(answer.split()) <= set(WORDS) for answer in fresh)


def test_saved_context_answers_like_a_fresh_one(tiny_dir, tmp_path, capsys, monkeypatch):
    base = [*model_args(tiny_dir), "--method", "cake-adakv", "--budget", "24", "--window", "8"]
    kvc = str(tmp_path / "doc.kvc")
    code, out, err = call(capsys, monkeypatch, ["save", *base, "--context-file", str(tiny_dir / "doc.txt"),
                                                "--out", kvc])  # fmt: skip
    assert code == 0, err
    assert out.strip() == kvc and "bytes written" in err
    ask = ["--question", "w3 w4", "--max-new-tokens", "6"]
    _, fresh, _ = call(
        capsys, monkeypatch, ["generate", *base, "--context-file", str(tiny_dir / "doc.txt"), *ask]
    )
    code, loaded, err = call(capsys, monkeypatch, ["generate", "--load", kvc, *model_args(tiny_dir), *ask])
    assert code == 0, err
    assert loaded == fresh and loaded.strip()
    code, _, err = call(capsys, monkeypatch, ["generate", "--load", kvc, "--method", "snapkv", *ask])
    assert (
        code == 2
        and "--load uses the method saved with the context, and its storage: drop --method/--budget/--keep-ratio/"
        in err
    )
    # chat --load refuses an answer past the model's positions at the load, not at the first
    # question (piped input without one exited 0 before)
    code, _, err = call(capsys, monkeypatch, ["chat", "--load", kvc, "--max-new-tokens", "5000"], stdin="")
    assert code == 2 and "positions, but the model has 4096" in err, err


def test_a_document_on_standard_input(tiny_dir, tmp_path, capsys, monkeypatch):
    """``--context-file -`` reads the document from stdin (it was "no such file: -"): generate and save
    answer as from the file; chat, whose questions come on stdin, refuses it before loading the model."""
    base = [*model_args(tiny_dir), "--method", "snapkv", *SMALL]
    document = (tiny_dir / "doc.txt").read_text()
    ask = ["--question", "w3 w4"]
    _, from_file, _ = call(
        capsys, monkeypatch, ["generate", *base, "--context-file", str(tiny_dir / "doc.txt"), *ask]
    )
    code, piped, err = call(
        capsys, monkeypatch, ["generate", *base, "--context-file", "-", *ask], stdin=document
    )
    assert code == 0, err
    assert piped == from_file and piped.strip()
    kvc = str(tmp_path / "piped.kvc")
    code, _, err = call(
        capsys, monkeypatch, ["save", *base[:-2], "--context-file", "-", "--out", kvc], stdin=document
    )
    assert code == 0, err
    _, loaded, _ = call(capsys, monkeypatch, ["generate", "--load", kvc, *ask, "--max-new-tokens", "6"])
    assert loaded == from_file
    code, _, err = call(capsys, monkeypatch, ["generate", *base, "--context-file", "-", *ask], stdin="  \n")
    assert code == 2 and "standard input is empty" in err
    code, _, err = call(capsys, monkeypatch, ["chat", *base, "--context-file", "-"], stdin="w3 w4\n")
    assert code == 2 and "chat reads its questions from standard input: give the document as a file" in err


def test_a_saved_context_loads_the_model_in_its_dtype(tiny_dir, tmp_path, capsys, monkeypatch):
    """--load picks the dtype the context was saved in, as it picks its model (it said "load the model
    with dtype=torch.bfloat16", which the command line cannot do); another --dtype is refused."""
    base = [*model_args(tiny_dir), "--method", "snapkv", "--budget", "24", "--window", "8"]
    kvc = str(tmp_path / "doc.kvc")
    code, _, err = call(capsys, monkeypatch, ["save", *base, "--dtype", "bfloat16",
                                              "--context-file", str(tiny_dir / "doc.txt"), "--out", kvc])  # fmt: skip
    assert code == 0, err
    ask = ["--question", "w3 w4", "--max-new-tokens", "4"]
    _, fresh, _ = call(capsys, monkeypatch, ["generate", *base, "--dtype", "bfloat16",
                                             "--context-file", str(tiny_dir / "doc.txt"), *ask])  # fmt: skip
    code, loaded, err = call(capsys, monkeypatch, ["generate", "--load", kvc, *model_args(tiny_dir), *ask])
    assert code == 0, err
    assert loaded == fresh and loaded.strip()
    code, _, err = call(capsys, monkeypatch, ["generate", "--load", kvc, *model_args(tiny_dir), "--dtype", "float32",
                                              *ask])  # fmt: skip
    assert code == 2 and "holds bfloat16 keys and values" in err and "--dtype bfloat16" in err


def test_no_chat_template_and_ratio(tiny_dir, capsys, monkeypatch):
    code, out, err = call(capsys, monkeypatch, ["generate", *model_args(tiny_dir), "--no-chat-template",
                                                "--context-file", str(tiny_dir / "doc.txt"), "--question", "w9",
                                                "--method", "snapkv", "--ratio", "0.25", "--window", "8"])  # fmt: skip
    assert code == 0, err
    assert "snapkv kept" in err and out.strip()


def test_inspect_writes_figures(tiny_dir, tmp_path, capsys, monkeypatch):
    import matplotlib.image

    out_dir = tmp_path / "figs"
    code, out, err = call(capsys, monkeypatch, ["inspect", *model_args(tiny_dir), "--context-file",
                                                str(tiny_dir / "doc.txt"), "--out", str(out_dir), *SMALL[:4]])  # fmt: skip
    assert code == 0, err
    paths = out.splitlines()
    assert len(paths) == 4
    for p in paths:
        assert p.startswith(str(out_dir)) and matplotlib.image.imread(p).shape[:2] == (800, 1200)


def test_inspect_refuses_a_file_as_its_folder_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    """--out naming a file was an error from mkdir after the model had loaded and compressed."""
    from kvcake.cli import inspect as inspect_cli

    taken = tmp_path / "figs.png"
    taken.write_bytes(b"x")
    monkeypatch.setattr(inspect_cli, "_load", lambda args: pytest.fail("the model was loaded"))
    code, _, err = call(
        capsys, monkeypatch, ["inspect", *model_args(tiny_dir), "--prompt", "w1", "--out", str(taken)]
    )
    assert code == 2 and f"--out {taken} is a file: give a folder for the PNG files" in err
    assert taken.read_bytes() == b"x"


# Refused before the model loads, naming the flag (the library's messages name its keywords)
FLAG_ERRORS = [
    (["generate", "--prompt", "w1", "--window", "0"], "--window must be at least 1 token, got 0"),
    (["generate", "--prompt", "w1", "--kv-recent", "4"], "pass --kv-dtype fp8 with it, or drop --kv-recent"),
    (["chat", "--context-file", "DOC", "--kv-dtype", "fp8", "--kv-recent", "-1"],
     "--kv-recent must be a count"),
    (["generate", "--prompt", "w1", "--method", "snapkv", "--scenario", "context"],
     "--method 'snapkv' has no CAKE layer allocation (layers=cake): drop --scenario"),
    (["save", "--context-file", "DOC", "--out", "x.kvc", "--method", "layers=pyramid,score=cake",
      "--scenario", "question"], "--method 'layers=pyramid,score=cake' has no CAKE layer allocation"),
    (["chat", "--context-file", "DOC", "--method", "full", "--scenario", "question"], "drop --scenario"),
    (["inspect", "--prompt", "w1", "--out", "o", "--ada-method", "snapkv"],
     "--ada-method 'snapkv' gives every KV head of a layer the same budget"),
]  # fmt: skip


@pytest.mark.parametrize("args, message", FLAG_ERRORS)
def test_flag_errors_name_the_flag_before_loading(tiny_dir, tmp_path, capsys, monkeypatch, args, message):
    from kvcake.cli import common, generate, inspect

    for module in (common, generate, inspect):
        monkeypatch.setattr(module, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.chdir(tmp_path)
    args = [str(tiny_dir / "doc.txt") if a == "DOC" else a for a in args]
    code, out, err = call(capsys, monkeypatch, [*args, *model_args(tiny_dir)])
    assert code == 2 and err.startswith("kvcake: error: ") and message in err, err


def test_scenario_goes_with_any_method_in_inspect_and_with_composed_cake(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    """``inspect``'s layer-preference figure runs CAKE whatever the method: --scenario picks its
    temperatures there; a composed method with CAKE's layers takes it anywhere."""
    figs = ["--out", str(tmp_path / "figs"), "--method", "snapkv", "--scenario", "context", *SMALL[:4]]
    code, _, err = call(
        capsys, monkeypatch, ["inspect", *model_args(tiny_dir), "--prompt", "w1 w2 w3", *figs]
    )
    assert code == 0, err
    cake = ["--method", "layers=cake,score=snapkv", "--scenario", "context", *SMALL]
    code, _, err = call(
        capsys, monkeypatch, ["generate", *model_args(tiny_dir), "--prompt", "w1 w2 w3", *cake]
    )
    assert code == 0 and "context-only: scenario='context' given" in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--context-file", "missing.txt", "--question", "q"], "no such file"),
        (["chat", "--context-file", "missing.txt"], "no such file"),
        (["generate", "--load", "missing.kvc", "--question", "q"], "no such context file"),
        (["generate", "--prompt", "w1", "--method", "layers=cake,heads=nope"], "unknown heads 'nope'"),
        (["save", "--context-file", "DOC", "--out", "x.kvc", "--method", "cake,layers.bogus=1"], "bad option"),
        (["generate", "--prompt", "w1", "--budget", "0"], "--budget must be at least 1 entry per layer"),
        (["generate", "--prompt", "w1", "--budget", "-5"], "--budget must be at least 1 entry per layer"),
        (["generate", "--prompt", "w1", "--ratio", "1.5"], "--keep-ratio must be in (0, 1], got 1.5"),
        (["generate", "--prompt", "w1", "--budget", "16"], "--window 32 is larger than --budget 16"),
        (["generate", "--prompt", "w1", "--max-new-tokens", "0"], "max-new-tokens"),
        (["generate", "--context-file", "DOC"], "need --question"),
        (["inspect", "--prompt", "w1", "--out", "o", "--ada-method", "adakv2"], "unknown method 'adakv2'"),
        (["generate", "--prompt", "w1", "--method", "cake,layers.tau1=abc"], "tau1 must be a number, got 'abc'"),
        (["generate", "--prompt", "w1", "--method", "cake,score.gama=1"], "valid: gamma, kernel, pooling, reduce"),
        (["generate", "--prompt", "w1", "--method", "layers=pyramid,layers=uniform"], "'layers' is given twice"),
        (["generate", "--prompt", "w1", "--method", "cake,,select=critical"], "empty part in method"),
        (["generate", "--prompt", "w1", "--method", "full", "--budget", "64"], "--method full keeps every entry"),
        (["generate", "--prompt", "w1", "--method", "full", "--window", "10"], "keeps every entry: drop --window"),
        (["generate", "--prompt", "w1", "--keep-ratio", "0"], "--keep-ratio must be in (0, 1], got 0.0"),
        (["generate", "--prompt", "w1", "--temperature", "0.7"], "--temperature only applies with --sample"),
        (["generate", "--prompt", "w1", "--top-p", "0.9", "--seed", "1"], "--top-p, --seed only apply with --sample"),
        (["generate", "--prompt", "w1", "--sample", "--temperature", "0"], "--temperature must be positive"),
        (["generate", "--prompt", "w1", "--sample", "--top-p", "2"], "--top-p must be in (0, 1]"),
        (["generate", "--prompt", "w1", "--max-new-tokens", "5000"], "positions, but the model has 4096"),
        (["generate", "--prompt", "w1", "--num-beams", "0"], "--num-beams must be at least 1, got 0"),
        (["generate", "--prompt", "w1", "--num-beams", "2", "--compile"], "beam search runs eagerly: drop --compile"),
        (["generate", "--prompt", "w1", "--compile", "--dynamic"], "drop --dynamic"),
        (["generate", "--context-file", "DOC", "--question", "w1", "--max-new-tokens", "4000"],
         "positions, but the model has 4096"),
    ],
)  # fmt: skip
def test_input_errors_are_one_line(tiny_dir, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    args = [str(tiny_dir / "doc.txt") if a == "DOC" else a for a in args]
    code, out, err = call(capsys, monkeypatch, [*args, *model_args(tiny_dir)])
    assert code == 2
    assert err.startswith("kvcake: error: ") and err.count("\n") == 1 and message in err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_corrupted_and_foreign_context_files(tiny_dir, tmp_path, capsys, monkeypatch, make_tiny_llama):
    kvc = tmp_path / "doc.kvc"
    code, _, err = call(capsys, monkeypatch, ["save", *model_args(tiny_dir), "--context-file",
                                              str(tiny_dir / "doc.txt"), "--out", str(kvc), *SMALL[:4]])  # fmt: skip
    assert code == 0, err
    data = kvc.read_bytes()
    (tmp_path / "cut.kvc").write_bytes(data[: len(data) // 3])
    code, _, err = call(
        capsys, monkeypatch, ["chat", "--load", str(tmp_path / "cut.kvc"), *model_args(tiny_dir)]
    )
    assert code == 2 and "truncated" in err and err.count("\n") == 1
    other = tmp_path / "mha"
    make_tiny_llama(num_key_value_heads=4).save_pretrained(other)
    for f in tiny_dir.glob("tokenizer*"):
        (other / f.name).write_bytes(f.read_bytes())
    code, _, err = call(capsys, monkeypatch, ["chat", "--load", str(kvc), "--model", str(other)])
    assert code == 2 and "was saved for model" in err and err.count("\n") == 1


def test_usage_errors_exit_2(capsys, monkeypatch):
    assert call(capsys, monkeypatch, [])[0] == 2
    code, _, err = call(capsys, monkeypatch, ["generate", "--prompt", "x", "--budget", "abc"])
    assert code == 2 and "invalid int value" in err
    code, _, err = call(capsys, monkeypatch, ["generate", "--prompt", "x", "--budget", "3", "--ratio", "0.5"])
    assert code == 2 and "not allowed with" in err
    code, _, err = call(capsys, monkeypatch, ["eval", "--lengths", "3x"])  # the message says 2k is taken
    assert code == 2 and "expected comma-separated integers (k = 1024: 2k,4096), got '3x'" in err


def test_extension_commands_plug_in(capsys, monkeypatch):
    """The hook point others use: a module in EXTENSIONS with configure_parser(subparsers) and run(args)."""
    module = types.ModuleType("fake_ext")

    def configure_parser(subparsers):
        p = subparsers.add_parser("fake", help="a fake extension")
        p.add_argument("--n", type=int, required=True)
        return p

    def run(args):
        if args.n < 0:
            raise ValueError("n must be >= 0")
        print(f"fake ran with {args.n}")
        return 0

    module.configure_parser, module.run, module.EXAMPLES = configure_parser, run, ("kvcake fake --n 3",)
    monkeypatch.setitem(sys.modules, "fake_ext", module)
    monkeypatch.setattr(cli, "EXTENSIONS", {"fake": "fake_ext", "missing": "no_such_package.cli"})
    assert call(capsys, monkeypatch, ["fake", "--n", "3"])[:2] == (0, "fake ran with 3\n")
    code, _, err = call(capsys, monkeypatch, ["fake", "--n", "-1"])
    assert code == 2 and err == "kvcake: error: n must be >= 0\n"
    code, out, _ = call(capsys, monkeypatch, ["--help"])
    assert "a fake extension" in out and "kvcake fake --n 3" in out and "missing" not in out


@pytest.mark.integration
def test_real_model_document_questions(tmp_path, capsys, monkeypatch):
    """SmolLM2 with its chat template. A budget covering the document answers exactly like
    plain ``model.generate`` on the same ids; a compressed one answers the same fresh, from
    ``chat`` and from a saved file."""
    import torch

    import kvcake
    from kvcake.prompts import build_prompt

    doc = tmp_path / "doc.txt"
    filler = "The weather was mild and the market was busy as usual. "
    doc.write_text(filler * 4 + "The secret password is PINEAPPLE. " + filler * 4 + "\n")
    question = "What is the secret password?"
    ask = ["--context-file", str(doc), "--question", question, "--max-new-tokens", "10"]
    code, full, err = call(capsys, monkeypatch, ["generate", *ask, "--budget", "4096"])
    assert code == 0, err
    assert "(100.0%)" in err
    model, tokenizer = kvcake.load_model()
    ids = build_prompt(tokenizer, doc.read_text().strip() + "\n\n", question).full
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert full.strip() == tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True).strip()
    code, fresh, err = call(
        capsys, monkeypatch, ["generate", *ask, "--method", "cake-adakv", "--budget", "64"]
    )
    assert code == 0 and fresh.strip(), err
    kvc = str(tmp_path / "doc.kvc")
    save = ["save", "--context-file", str(doc), "--out", kvc, "--method", "cake-adakv", "--budget", "64"]
    assert call(capsys, monkeypatch, save)[0] == 0
    code, chat, err = call(capsys, monkeypatch, ["chat", "--load", kvc, "--max-new-tokens", "10"],
                           stdin=f"{question}\n{question}\n")  # fmt: skip
    assert code == 0, err
    assert chat.splitlines() == [fresh.strip()] * 2


def test_full_keep_ratio_sampling_and_defaults(tiny_dir, capsys, monkeypatch):
    doc = str(tiny_dir / "doc.txt")
    question = ["--context-file", doc, "--question", "w1 w2", "--max-new-tokens", "6", *model_args(tiny_dir)]
    code, out_full, err = call(capsys, monkeypatch, ["generate", *question, "--method", "full"])
    assert code == 0, err
    assert "context: full kept" in err and "(100.0%)" in err
    # no size given: a document keeps DEFAULT_KEEP_RATIO["context"] (0.5) of its tokens
    code, _, err = call(capsys, monkeypatch, ["-v", "generate", *question, "--method", "snapkv"])
    assert code == 0 and "ratio=0.5" in err, err
    # --keep-ratio is --ratio under a clear name
    a = call(capsys, monkeypatch, ["generate", *question, "--keep-ratio", "0.4"])
    b = call(capsys, monkeypatch, ["generate", *question, "--ratio", "0.4"])
    assert a[0] == b[0] == 0 and a[1] == b[1]
    # sampling: the seed makes it repeatable
    sample = ["generate", *question, "--method", "full", "--sample", "--temperature", "5", "--seed", "3"]
    first, again = call(capsys, monkeypatch, sample), call(capsys, monkeypatch, sample)
    assert first[0] == 0 and first[1] == again[1] and first[1] != out_full


def test_help_is_for_users(capsys, monkeypatch):
    """Every command: -v, no developer notes, every option explained, --load only where it exists."""
    for command in ("generate", "chat", "inspect", "methods", "save", "eval", "bench", "calibrate"):
        code, out, _ = call(capsys, monkeypatch, [command, "--help"])
        assert code == 0 and "-v, --verbose" in out, command
        assert "configure_parser" not in out and "EXTENSIONS" not in out, command
        assert ("--load" in out) == (command in ("generate", "chat")), command
        if command in ("eval", "calibrate", "generate"):
            assert "--device" in out and "--dtype" in out, command
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"kvcake {name} {action.option_strings} has no help"


def test_readme_command_lines_run(tiny_dir, tmp_path, capsys, monkeypatch):
    """The README's ``kvcake`` lines, verbatim but for --model (the tiny model), from a folder
    holding doc.txt."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Command line") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) >= 5
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text((tiny_dir / "doc.txt").read_text())
    for line in lines:
        stdin = ""
        if "|" in line:
            feed, line = (part.strip() for part in line.split("|", 1))
            stdin = shlex.split(feed)[1].encode().decode("unicode_escape")
        argv = shlex.split(line)
        assert argv[0] == "kvcake", line
        extra = [] if "--load" in argv or argv[1] == "methods" else model_args(tiny_dir)
        code, out, err = call(capsys, monkeypatch, [*argv[1:], *extra], stdin=stdin)
        assert code == 0, f"{line}: {err}"
        if "chat" in argv:
            assert len(out.splitlines()) == 2, "two questions, two answers"


def test_scenario_picks_the_temperature_set(tiny_dir, tmp_path, capsys, monkeypatch):
    """--prompt uses the question-aware set, --context-file the context-only one, --scenario
    overrides either; the summary line says which set and why (issue 24)."""
    from kvcake import load_model, temperatures
    from kvcake.models import model_fingerprint
    from kvcake.temperatures import Calibration, TauPoint, save_calibration

    monkeypatch.setenv("KVCAKE_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(temperatures, "SHIPPED_DIR", tmp_path / "shipped")
    fp = model_fingerprint(load_model(str(tiny_dir))[0])
    sets = {"question": (TauPoint(10, 0.3, 2.5),), "context": (TauPoint(10, 3.0, 6.0),)}
    save_calibration(Calibration(fp, sets, "tiny"))
    prompt = ["generate", *model_args(tiny_dir), "--prompt", "w1 w2 " * 60, *SMALL]
    document = ["generate", *model_args(tiny_dir), "--context-file", str(tiny_dir / "doc.txt"), "--question",
                "w3 w4", *SMALL]  # fmt: skip
    for args, want in (
        (prompt, "tau1=0.3 tau2=2.5 (calibrated; question-aware, question set: kvcake generate --prompt"),
        (document, "tau1=3 tau2=6 (calibrated; context-only, context set: kvcake generate --context-file"),
        ([*prompt, "--scenario", "context"], "tau1=3 tau2=6 (calibrated; context-only, context set: "
                                             "scenario='context' given"),
        ([*document, "--scenario", "question"], "tau1=0.3 tau2=2.5 (calibrated; question-aware, question set"),
    ):  # fmt: skip
        code, out, err = call(capsys, monkeypatch, args)
        assert code == 0 and want in err, err
    code, out, err = call(capsys, monkeypatch, ["inspect", *model_args(tiny_dir), "--prompt", "w1 w2 " * 40,
                                                "--out", str(tmp_path / "figs"), *SMALL[:4]])  # fmt: skip
    assert len(out.splitlines()) == 4  # stdout: the figures' paths only
    assert (
        code == 0
        and "cake: CAKE tau1=0.3 tau2=2.5 (calibrated; question-aware, question set: kvcake inspect" in err
    )
    code, out, err = call(capsys, monkeypatch, ["methods"])
    assert "question: 0.3/2.5 at 10; context: 3/6 at 10" not in out  # only shipped ones are listed
    assert "--scenario" in out
    code, out, err = call(capsys, monkeypatch, [*prompt, "--scenario", "document"])
    assert code == 2 and "invalid choice: 'document'" in err


def test_generate_compile_reaches_a_compressed_contexts_generate(tiny_dir, tmp_path, capsys, monkeypatch):
    """``--compile`` with ``--context-file`` reaches ``CompressedContext.generate(compile=True)``
    (it was refused: a compressed document decoded eagerly); without it, None (transformers
    decides, eager on a CPU). A recording backend stands in for inductor; the tokens are eager's."""
    import torch
    from transformers import CompileConfig

    from kvcake.context import CompressedContext
    from shared_checks import KWARGS_HANDOFF, graph_recorder

    (backend, graphs), seen = graph_recorder(), []
    real = CompressedContext.generate

    def recording(self, *args, compile=None, **kwargs):
        seen.append(compile)
        if compile is True:
            compile = CompileConfig(fullgraph=True, backend=backend, mode=None)
        return real(self, *args, compile=compile, **kwargs)

    monkeypatch.setattr(CompressedContext, "generate", recording)
    doc = tmp_path / "doc.txt"
    doc.write_text("w1 w2 " * 40)
    args = ["generate", *model_args(tiny_dir), "--context-file", str(doc), "--question", "w3 w4", *SMALL]
    eager = call(capsys, monkeypatch, args)
    torch._dynamo.reset()
    compiled = call(capsys, monkeypatch, [*args, "--compile"])
    assert seen == [None, True]
    if KWARGS_HANDOFF:
        assert eager[0] == compiled[0] == 0, compiled[2]
        assert compiled[1] == eager[1] and len(graphs) == 1
    else:
        assert compiled[0] == 2 and "upgrade transformers or use compile=False" in compiled[2]


def test_generate_compile_decodes_the_same_tokens(tiny_dir, capsys, monkeypatch):
    """``--compile`` reaches ``kvcake.generate(compile=...)`` (without it, None: transformers
    decides, eager on a CPU), ``--dynamic`` reaches ``static=False``: on a release that hands the
    attention kwargs to ``cache.update`` the compiled decoding gives eager's tokens, and so does
    the dynamic reference (a recording backend stands in for inductor, whose compile takes minutes
    on this CPU); elsewhere a one-line error."""
    import torch
    from transformers import CompileConfig

    from kvcake import api
    from shared_checks import KWARGS_HANDOFF, graph_recorder

    (backend, graphs), seen = graph_recorder(), []
    real = api.generate

    def recording(*args, compile=None, static=True, **kwargs):
        seen.append((compile, static))
        if compile is True:
            compile = CompileConfig(fullgraph=True, backend=backend, mode=None)
        return real(*args, compile=compile, static=static, **kwargs)

    monkeypatch.setattr(api, "generate", recording)
    args = ["generate", *model_args(tiny_dir), "--prompt", "w1 w2 " * 40, *SMALL]
    eager = call(capsys, monkeypatch, args)
    torch._dynamo.reset()
    compiled = call(capsys, monkeypatch, [*args, "--compile"])
    dynamic = call(capsys, monkeypatch, [*args, "--dynamic"])
    assert seen == [(None, True), (True, True), (None, False)]
    assert dynamic[0] == 0 and dynamic[1] == eager[1], dynamic[2]
    if KWARGS_HANDOFF:
        assert eager[0] == compiled[0] == 0, compiled[2]
        assert compiled[1] == eager[1] and len(graphs) == 1
    else:
        assert compiled[0] == 2 and "upgrade transformers or use compile=False" in compiled[2]
