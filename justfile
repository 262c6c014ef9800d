# controlplane tasks. `just --list` shows them all.
venv := ".venv"
py := venv / "bin/python"

# Create the virtualenv and install the project with its dev tools.
setup:
    test -x {{py}} || python3 -m venv {{venv}}
    {{py}} -m pip install --quiet --upgrade pip
    {{py}} -m pip install --quiet -e '.[dev]'

# Run the daemon (embedded PostgreSQL unless a database URL is configured).
serve *ARGS:
    {{venv}}/bin/controlplane serve {{ARGS}}

# Apply pending migrations.
migrate *ARGS:
    {{venv}}/bin/controlplane migrate {{ARGS}}

# Run the test suite against real PostgreSQL.
test *ARGS:
    {{py}} -m pytest {{ARGS}}

# Lint, format check, strict typing, then the tests.
check: browser
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .
    {{venv}}/bin/mypy
    {{py}} -m pytest -q

# Playwright cannot download a browser here: tests/browser/ drives Debian's chromium, installed
# when missing and we are root with apt-get; otherwise those tests skip and say why.
# Install Debian's chromium for the browser tests (when missing, as root).
browser:
    #!/usr/bin/env sh
    if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
            || echo "could not install chromium: the browser tests will skip" >&2
    fi

# Format the tree.
fmt:
    {{venv}}/bin/ruff format .
    {{venv}}/bin/ruff check --fix .

# Run the benchmarks (never part of the test run).
bench *ARGS:
    {{py}} -m bench {{ARGS}}
