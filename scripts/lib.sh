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
}
