"""`pddjax generate`: JSON output, and bad input gives one sentence and exit code 2."""

import json
import subprocess
import sys

import pytest

from serving.cli import main


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_has_the_fields(capsys):
    rc, out, _ = run_cli(capsys, "generate", "--model", "tiny", "--prompt-ids", "5,6,7", "--max-tokens", "4", "--json")
    assert rc == 0
    obj = json.loads(out)
    assert obj["prompt_ids"] == [5, 6, 7] and len(obj["token_ids"]) == 4
    assert obj["finish_reason"] in ("stop", "length") and "text" in obj


@pytest.mark.parametrize("argv, needle", [
    (["--model", "nope", "--prompt", "x"], "unknown model"),
    (["--model", "/nonexistent/m.gguf", "--prompt", "x"], "not found"),
    (["--model", "tiny", "--prompt-ids", ""], "empty"),
    (["--model", "tiny", "--prompt-ids", "1,512"], "outside the vocabulary"),
    (["--model", "tiny", "--prompt-ids", "1,-3"], "outside the vocabulary"),
    (["--model", "tiny", "--prompt-ids", "1,x"], "integers"),
    (["--model", "tiny", "--prompt-ids", "1", "--temperature", "-1"], "temperature"),
    (["--model", "tiny", "--prompt-ids", "1", "--top-p", "0"], "top-p"),
    (["--model", "tiny", "--prompt-ids", "1", "--top-p", "1.5"], "top-p"),
    (["--model", "tiny", "--prompt-ids", "1", "--max-tokens", "0"], "max-tokens"),
    (["--model", "tiny", "--prompt-ids", "1", "--max-tokens", "100000"], "context"),
    (["--model", "tiny", "--prompt", "hello"], "no tokenizer"),
])
def test_bad_input_one_sentence_exit_2(capsys, argv, needle):
    rc, out, err = run_cli(capsys, "generate", *argv)
    assert rc == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_not_a_gguf_file(tmp_path, capsys):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"not a gguf at all")
    rc, _, err = run_cli(capsys, "generate", "--model", str(bad), "--prompt", "x")
    assert rc == 2 and "GGUF" in err


def test_console_script_exit_code_without_traceback():
    p = subprocess.run([sys.executable, "-m", "serving", "generate", "--model", "nope", "--prompt", "x"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "unknown model" in p.stderr


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_generate_through_paged_engine_matches_reference(capsys, attention):
    base = ["generate", "--model", "tiny", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "5", "--json"]
    rc, out, _ = run_cli(capsys, *base)
    ref = json.loads(out)
    rc2, out2, _ = run_cli(capsys, *base, "--attention", attention, "--page-size", "4")
    got = json.loads(out2)
    assert rc == rc2 == 0 and got["engine"] == f"paged-{attention}"
    assert got["token_ids"] == ref["token_ids"]
