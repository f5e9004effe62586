"""Encodings (issue 32, item 8): a JSONL file is read as UTF-8, with or without a byte-order mark;
a file in any other encoding is refused once, naming the file, the encoding found and the command
that converts it, before anything is tokenized (before: a UTF-16 file had its first record skipped
as malformed and the other 18 tokenized after ``json`` guessed UTF-16-BE line by line)."""

from __future__ import annotations

import codecs
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from runner import FAST, REPO, env_for
from transformers import AutoTokenizer

from dflash.config import DataConfig, TinyTargetConfig
from dflash.data.cache import build_or_load_dataset


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def text(n: int = 19) -> str:
    """``n`` chat records with accented text (the issue's file had 19)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Résumé n°{i}: écris une fonction"},
                {"role": "assistant", "content": f"def f{i}(x):\n    return 'déjà vu {i}'"},
            ]
        }
        for i in range(n)
    ]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


ENCODINGS = {  # name -> (bytes of the file, what the refusal names)
    "utf-16 with BOM (Notepad, PowerShell)": (text().encode("utf-16"), "is UTF-16LE (byte-order mark FF FE)"),
    "utf-16-be with BOM": (
        codecs.BOM_UTF16_BE + text().encode("utf-16-be"),
        "is UTF-16BE (byte-order mark FE FF)",
    ),
    "utf-16-le without BOM": (text().encode("utf-16-le"), "is UTF-16LE (NUL bytes between the characters"),
    "utf-32 with BOM": (text().encode("utf-32"), "is UTF-32LE (byte-order mark FF FE 00 00)"),
    "utf-32-be without BOM": (text().encode("utf-32-be"), "is UTF-32BE (NUL bytes"),
    "latin-1": (
        text().encode("latin-1"),
        "is Windows-1252, not UTF-8: line 1, column 45 has byte 0xE9 ('é' in Windows-1252)",
    ),
}


def cfg_for(tmp_path: Path, src: Path) -> DataConfig:
    return DataConfig(path=str(src), cache_dir=str(tmp_path / "cache"), max_length=128, num_eval_prompts=0)


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_another_encoding_is_refused_naming_it_and_the_converted_file_trains(tok, tmp_path, name):
    data, named = ENCODINGS[name]
    src = tmp_path / "my data.jsonl"
    src.write_bytes(data)
    with pytest.raises(ValueError) as err:
        build_or_load_dataset(cfg_for(tmp_path, src), tok, len(tok))
    msg = str(err.value)
    assert msg.startswith(f"data.path={str(src)!r} {named}") and "iconv" in msg
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing tokenized
    if shutil.which("iconv") is None:
        pytest.skip("no iconv on this machine to run the printed conversion")
    convert = msg[msg.index("iconv") : msg.index(" and set data.path")]
    subprocess.run(["bash", "-c", convert], check=True, cwd=tmp_path)  # pasted as printed
    utf8 = tmp_path / "my data.utf8.jsonl"
    ds = build_or_load_dataset(cfg_for(tmp_path, utf8), tok, len(tok))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(text(), encoding="utf-8")
    want = build_or_load_dataset(cfg_for(tmp_path, plain), tok, len(tok))
    assert len(ds) == 19 and ds.num_skipped == 0 and ds.tokens.tolist() == want.tokens.tolist()


def test_utf8_with_or_without_bom_reads_every_record_and_a_damaged_line_stays_one_skip(tok, tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) is read; a line that is not UTF-8 in a
    file with UTF-8 text elsewhere is a damaged record, skipped and counted, not a refusal."""
    plain, bom = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_text(text(), encoding="utf-8")
    bom.write_bytes(codecs.BOM_UTF8 + text().encode())
    a = build_or_load_dataset(cfg_for(tmp_path, plain), tok, len(tok))
    b = build_or_load_dataset(cfg_for(tmp_path, bom), tok, len(tok))
    assert len(a) == len(b) == 19 and b.num_skipped == 0 and a.tokens.tolist() == b.tokens.tolist()
    damaged = tmp_path / "damaged.jsonl"
    lines = text().encode().splitlines(keepends=True)
    lines[4] = lines[4].replace("é".encode(), b"\xe9")  # one record written in Latin-1
    damaged.write_bytes(b"".join(lines))
    c = build_or_load_dataset(cfg_for(tmp_path, damaged), tok, len(tok))
    assert len(c) == 18 and c.skipped["malformed"] == 1 and f"{damaged}:5" in c.skip_examples["malformed"]


def test_prepare_refuses_a_utf16_file_in_one_line(tmp_path, tiny_target_dir):
    """The issue's case through the app: one line naming the file and the encoding, exit 2, no
    record tokenized."""
    src = tmp_path / "chat.jsonl"
    src.write_bytes(text().encode("utf-16"))
    cache = tmp_path / "cache"
    shutil.copytree(tiny_target_dir, cache / TinyTargetConfig().cache_subdir())
    cmd = [
        sys.executable,
        "-m",
        "dflash.data.prepare",
        *FAST,
        f"data.path={src}",
        f"hydra.run.dir={tmp_path / 'p'}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env_for(cache), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("dflash: error:")]
    assert f"data.path={str(src)!r} is UTF-16LE (byte-order mark FF FE), not UTF-8" in line
    assert "Traceback" not in proc.stderr and "skipped" not in proc.stdout + proc.stderr
    assert not (cache / "data").exists() or not list((cache / "data").glob("*/meta.json"))
