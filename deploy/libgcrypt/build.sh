#!/usr/bin/env bash
# Builds libgcrypt 1.11 (SM4 on GFNI/AVX-512: ~2.8x the AES-NI/AVX2 path of Debian bookworm's 1.10) and the
# libgpg-error >= 1.49 it needs (bookworm has 1.46) from pinned upstream tarballs into PREFIX.
#
#   deploy/libgcrypt/build.sh PREFIX        (make gcrypt: PREFIX = .venv/opt/gcrypt, where security.gcrypt looks)
#
# Needs gcc, make, bzip2 and curl or wget (or python3). Tarballs are cached in $GCRYPT_CACHE_DIR
# (default ~/.cache/tianmen-gcrypt); GCRYPT_MIRROR replaces the Debian pool URL (the sha256s still apply).
# PREFIX/lib/libgcrypt.so.20 has a RUNPATH of PREFIX/lib and $ORIGIN, so it finds PREFIX/lib/libgpg-error.so.0
# (not the system's, too old for it) even where PREFIX is copied elsewhere.
# Exits at once when PREFIX already holds a loadable libgcrypt >= 1.11.
set -euo pipefail

GPGERR_VERSION=1.51
GPGERR_TARBALL=libgpg-error_${GPGERR_VERSION}.orig.tar.bz2
GPGERR_SHA256=be0f1b2db6b93eed55369cdf79f19f72750c8c7c39fc20b577e724545427e6b2
GCRYPT_VERSION=1.11.0
GCRYPT_TARBALL=libgcrypt20_${GCRYPT_VERSION}.orig.tar.bz2
GCRYPT_SHA256=09120c9867ce7f2081d6aaa1775386b98c2f2f246135761aae47d81f58685b9c
MIRROR=${GCRYPT_MIRROR:-http://deb.debian.org/debian/pool/main/libg}  # plain http is fine: sha256-pinned
CACHE_DIR=${GCRYPT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tianmen-gcrypt}

die() { echo "build.sh: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 PREFIX"
PREFIX=$(realpath -m "$1")  # absolute: configure and the check below need it
LIB=$PREFIX/lib/libgcrypt.so.20

# Loads LIB the way security.gcrypt does (dlopen, so its RPATH is exercised) and asks for >= 1.11.
has_new_gcrypt() {
  [ -e "$LIB" ] || return 1
  local dir
  dir=$(mktemp -d)
  cat > "$dir/check.c" <<'C'
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
  if (argc != 2) return 2;
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  const char *(*check)(const char *) = (const char *(*)(const char *))dlsym(lib, "gcry_check_version");
  const char *have = check ? check(NULL) : NULL;
  if (!have || !check("1.11.0")) { fprintf(stderr, "%s: version %s < 1.11\n", argv[1], have ? have : "?"); return 1; }
  printf("%s\n", have);
  return 0;
}
C
  local rc=0
  gcc -o "$dir/check" "$dir/check.c" -ldl && "$dir/check" "$LIB" > "$dir/version" || rc=1
  [ $rc -eq 0 ] && echo "libgcrypt $(cat "$dir/version") in $PREFIX"
  rm -rf "$dir"
  return $rc
}

if has_new_gcrypt 2>/dev/null; then exit 0; fi

fetch() {  # fetch FILE SUBDIR SHA256: into the cache, once; a bad copy is deleted, never used
  local file=$1 url=$MIRROR/$2/$1 sha=$3 dest=$CACHE_DIR/$1
  if [ ! -s "$dest" ]; then
    echo "downloading $url"
    if command -v curl > /dev/null; then curl -fsSL --retry 2 --connect-timeout 20 -o "$dest.part" "$url"
    elif command -v wget > /dev/null; then wget -q -t 3 -T 20 -O "$dest.part" "$url"
    else python3 -c 'import sys, urllib.request as u; u.urlretrieve(sys.argv[1], sys.argv[2])' "$url" "$dest.part"
    fi || { rm -f "$dest.part"; die "download failed: $url"; }
    mv "$dest.part" "$dest"
  fi
  local got
  got=$(sha256sum "$dest" | cut -c1-64)
  if [ "$got" != "$sha" ]; then
    rm -f "$dest"
    die "SHA256 MISMATCH for $url: want $sha, got $got. Deleted the download; not building"
  fi
}

for tool in gcc make bzip2 sha256sum; do
  command -v $tool > /dev/null || die "needs $tool (Debian: apt-get install build-essential bzip2)"
done
mkdir -p "$CACHE_DIR"
fetch "$GPGERR_TARBALL" libgpg-error "$GPGERR_SHA256"
fetch "$GCRYPT_TARBALL" libgcrypt20 "$GCRYPT_SHA256"

WORK=$(mktemp -d)
LOG=$CACHE_DIR/build.log
FRESH=0
[ -e "$PREFIX" ] || FRESH=1
# a half-installed prefix must not be mistaken for a build; only one we created is ours to delete
trap 'rc=$?; rm -rf "$WORK"; if [ $rc -ne 0 ] && [ $FRESH = 1 ]; then rm -rf "$PREFIX"; fi' EXIT
: > "$LOG"
JOBS=$(nproc 2> /dev/null || echo 2)
# '\$$ORIGIN': make turns $$ into $, the shell drops the backslash, the linker gets $ORIGIN
export LDFLAGS="-Wl,-rpath,\\\$\$ORIGIN ${LDFLAGS:-}"
export CFLAGS=${CFLAGS:--O2}

step() {  # step DESCRIPTION CMD...: output to the log; on failure its tail, and stop
  echo "  $1"
  if ! "${@:2}" >> "$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    die "$1 failed; full log: $LOG"
  fi
}

echo "building libgpg-error $GPGERR_VERSION and libgcrypt $GCRYPT_VERSION into $PREFIX (log: $LOG)"
tar -C "$WORK" -xjf "$CACHE_DIR/$GPGERR_TARBALL"
tar -C "$WORK" -xjf "$CACHE_DIR/$GCRYPT_TARBALL"
cd "$WORK/libgpg-error-$GPGERR_VERSION"
step "libgpg-error: configure" ./configure --prefix="$PREFIX" --disable-doc --disable-static --disable-tests \
  --disable-nls --disable-languages
step "libgpg-error: make" make -j"$JOBS"
step "libgpg-error: install" make install
cd "$WORK/libgcrypt-$GCRYPT_VERSION"
step "libgcrypt: configure" ./configure --prefix="$PREFIX" --disable-doc --disable-static \
  --with-libgpg-error-prefix="$PREFIX"
# SUBDIRS without tests/: its ~70 programs are only for `make check`
SUBDIRS="compat mpi cipher random src"
step "libgcrypt: make" make -j"$JOBS" SUBDIRS="$SUBDIRS"
step "libgcrypt: install" make install SUBDIRS="$SUBDIRS"

has_new_gcrypt || die "built, but $LIB does not load as libgcrypt >= 1.11 (see $LOG)"
# NOTE: not `ldd | grep -q`: under pipefail grep's early exit can kill ldd with SIGPIPE and fail a good build
deps=$(ldd "$LIB")
grep -q "$PREFIX/lib/libgpg-error.so.0" <<< "$deps" || die "$LIB does not resolve libgpg-error from $PREFIX/lib"
