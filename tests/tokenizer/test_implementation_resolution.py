"""``tokenizer.implementation`` runs the code it names, so it never picks a module up from the
current directory implicitly (``python -m olmoflow`` puts that directory on ``sys.path``): a
file there is loaded only when named by its path."""

from __future__ import annotations

import sys

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import BaseTokenizer, tokenizer_class

TOKENIZER = """
import pathlib
pathlib.Path("RAN").write_text(__name__)
from olmoflow.tokenizer import BaseTokenizer
class Tok(BaseTokenizer):
    pass
"""


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """A current directory as ``python -m olmoflow`` sees it: first on ``sys.path`` (and ``''``,
    as under ``python -c``). Modules the test loads are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), "", *sys.path])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.mark.parametrize("stem", ["evil", "tokenizer"])
def test_a_module_in_the_current_directory_is_not_imported(cwd, stem):
    (cwd / f"{stem}.py").write_text(TOKENIZER)
    with pytest.raises(OlmoflowError) as e:
        tokenizer_class(f"{stem}:Tok")
    msg = str(e.value)
    assert "\n" not in msg and "current directory" in msg
    assert f"tokenizer.implementation=./{stem}.py:Tok" in msg  # how to name it explicitly
    assert not (cwd / "RAN").exists() and stem not in sys.modules


def test_a_package_in_the_current_directory_is_not_imported(cwd):
    (cwd / "evilpkg").mkdir()
    (cwd / "evilpkg" / "__init__.py").write_text("")
    (cwd / "evilpkg" / "tok.py").write_text(TOKENIZER)
    with pytest.raises(OlmoflowError, match="current directory.*PYTHONPATH"):
        tokenizer_class("evilpkg.tok:Tok")
    assert not (cwd / "RAN").exists()


def test_a_module_on_pythonpath_is_the_users_choice(cwd, monkeypatch):
    (cwd / "mytok.py").write_text(TOKENIZER)
    monkeypatch.setenv("PYTHONPATH", str(cwd))
    assert tokenizer_class("mytok:Tok").__name__ == "Tok"


@pytest.mark.parametrize("spec", ["./evil.py:Tok", "evil.py:Tok", "{cwd}/evil.py:Tok",
                                  "sub/dir/evil.py:Tok"])
def test_a_file_named_by_its_path_is_loaded(cwd, spec):
    where = cwd / "sub" / "dir" if spec.startswith("sub/") else cwd
    where.mkdir(parents=True, exist_ok=True)
    (where / "evil.py").write_text(TOKENIZER)
    cls = tokenizer_class(spec.format(cwd=cwd))
    assert issubclass(cls, BaseTokenizer) and cls.__name__ == "Tok"
    assert (cwd / "RAN").exists()
    assert tokenizer_class(spec.format(cwd=cwd)) is cls  # loaded once: the same class


def test_without_the_current_directory_on_the_path_the_message_says_how(cwd, monkeypatch):
    # The installed `olmoflow` script: sys.path[0] is its bin directory, not the cwd.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(cwd))])
    (cwd / "evil.py").write_text(TOKENIZER)
    with pytest.raises(OlmoflowError, match=r"cannot be loaded: ModuleNotFoundError.*"
                                            r"tokenizer\.implementation=\./evil\.py:Tok"):
        tokenizer_class("evil:Tok")


@pytest.mark.parametrize("text, spec, match", [
    ("def broken(:\n", "./bad.py:Tok", "cannot be loaded: SyntaxError"),
    ("raise RuntimeError('boom')\n", "./bad.py:Tok", "cannot be loaded: RuntimeError: boom"),
    ("X = 1\n", "./bad.py:Tok", "defines no 'Tok'"),
    ("X = 1\n", "./bad.py:X", "not a BaseTokenizer subclass"),
    ("", "./missing.py:Tok", "no such file"),
])
def test_a_broken_file_is_one_line(cwd, text, spec, match):
    (cwd / "bad.py").write_text(text)
    with pytest.raises(OlmoflowError, match=match) as e:
        tokenizer_class(spec)
    assert "\n" not in str(e.value)
