"""kvforge/data_paths.py: $KVFORGE_DATA_DIR, else ../shared/data beside the checkout, else an error
naming both; ``--data-dir`` names the same folder (or the dataset's own); the CLI help names the rule,
never a machine's path."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvforge import data_paths
from kvforge.eval import gsm8k, kld
from kvforge.eval.cli import add_gsm8k_args, add_kld_args

CHECKOUT = Path(__file__).resolve().parents[1]


def _gsm8k_folder(root: Path) -> Path:
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "test.jsonl").write_text("{}\n")
    return root / "gsm8k"


def test_environment_variable_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_DATA_DIR", str(tmp_path))
    _gsm8k_folder(tmp_path)
    assert data_paths.shared_data_dir() == tmp_path.resolve()
    assert gsm8k.gsm8k_dir() == tmp_path.resolve() / "gsm8k"
    assert kld.default_text_path() == tmp_path.resolve() / "text" / "tinyshakespeare.txt"


def test_environment_variable_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="KVFORGE_DATA_DIR=.*missing is not a directory"):
        data_paths.shared_data_dir()


def test_beside_the_checkout(tmp_path, monkeypatch):
    """Without the variable: <checkout>/../shared/data, found relative to the package's source."""
    monkeypatch.delenv("KVFORGE_DATA_DIR", raising=False)
    assert data_paths.beside_checkout() == CHECKOUT.parent / "shared" / "data"
    fake_checkout = tmp_path / "repo" / "kvforge"
    fake_checkout.mkdir(parents=True)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    monkeypatch.setattr(data_paths, "__file__", str(fake_checkout / "data_paths.py"))
    assert data_paths.shared_data_dir() == (tmp_path / "shared" / "data").resolve()


def test_neither_is_an_error_naming_both(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFORGE_DATA_DIR", raising=False)
    fake_checkout = tmp_path / "repo" / "kvforge"
    fake_checkout.mkdir(parents=True)
    monkeypatch.setattr(data_paths, "__file__", str(fake_checkout / "data_paths.py"))
    with pytest.raises(FileNotFoundError) as exc:
        data_paths.shared_data_dir()
    msg = str(exc.value)
    assert "KVFORGE_DATA_DIR" in msg and str(tmp_path / "shared" / "data") in msg
    with pytest.raises(FileNotFoundError, match="or pass --data-dir DIR$"):  # each command names its flag
        gsm8k.gsm8k_dir()
    from kvforge.eval.kld import default_text_path

    with pytest.raises(FileNotFoundError, match="or pass --text FILE$"):
        default_text_path()


def test_data_dir_names_what_the_variable_names_or_the_dataset_folder(tmp_path, monkeypatch):
    """``--data-dir`` DIR holding gsm8k/ (what $KVFORGE_DATA_DIR names) and the gsm8k/ folder itself find the
    same folder, whatever the variable says."""
    monkeypatch.setenv("KVFORGE_DATA_DIR", str(tmp_path / "elsewhere"))  # not read when --data-dir is given
    folder = _gsm8k_folder(tmp_path / "data")
    assert gsm8k.gsm8k_dir(tmp_path / "data") == folder
    assert gsm8k.gsm8k_dir(str(folder)) == folder


def test_data_dir_with_neither_layout_names_both_and_the_fix(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()  # a gsm8k/ folder without its test split
    with pytest.raises(FileNotFoundError) as exc:
        gsm8k.gsm8k_dir(tmp_path)
    msg = str(exc.value)
    assert msg.startswith(f"gsm8k data not found: no test.jsonl in {tmp_path / 'gsm8k'} or {tmp_path};")
    assert "fix: pass --data-dir DIR where DIR holds gsm8k/test.jsonl (the folder KVFORGE_DATA_DIR names) or is " \
        "the gsm8k/ folder itself" in msg
    monkeypatch.setenv("KVFORGE_DATA_DIR", str(tmp_path / "gsm8k"))  # the variable names the data folder only
    with pytest.raises(FileNotFoundError, match="fix: set KVFORGE_DATA_DIR=DIR where DIR holds gsm8k/test.jsonl"):
        gsm8k.gsm8k_dir()


def test_cli_help_names_the_rule_not_a_path(tmp_path, monkeypatch):
    """The parsers build without any data folder, and their help shows no absolute path."""
    monkeypatch.delenv("KVFORGE_DATA_DIR", raising=False)
    monkeypatch.setattr(data_paths, "__file__", str(tmp_path / "repo" / "kvforge" / "data_paths.py"))
    for add in (add_gsm8k_args, add_kld_args):
        text = add(argparse.ArgumentParser()).format_help()
        assert "KVFORGE_DATA_DIR" in text and "../shared/data" in text
        assert str(CHECKOUT.parent) not in text and str(tmp_path) not in text
