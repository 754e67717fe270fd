#!/usr/bin/env bash
# The WSL2 distro for Windows volunteers: a root filesystem tarball that `wsl --import` takes, with
# the worker in it (`/usr/bin/dedloc worker`; the Windows app runs it through wsl.exe):
#   dist/dedloc-volunteer-VERSION-wsl-MACHINE.tar.gz
# It holds the Linux bundle without its GUI (Qt: the tray app runs on Windows), the system
# libraries the rest links to, copied from this machine (glibc and what ldd names), a shell, the CA
# certificates and the few files a root filesystem needs. tests/test_installer.py runs the worker in
# it under chroot, with nothing of this machine's files.
# Usage: installers/build_wsl.sh   (after the bundle: dist/dedloc). Environment: PYTHON, TAR_GZIP_LEVEL.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TAR_GZIP_LEVEL=${TAR_GZIP_LEVEL:-1}
NAME=dedloc-volunteer
VERSION=$("$PY" -c 'import dedloc_core; print(dedloc_core.__version__)')
MACHINE=$(uname -m)
DIST=dist
STAGE=$PWD/build/wsl
ROOTFS=$STAGE/rootfs
[ -x "$DIST/dedloc/dedloc" ] || { echo "No bundle at $DIST/dedloc/dedloc: build it first." >&2; exit 1; }
t=$(date +%s.%N)

rm -rf "$STAGE"
mkdir -p "$ROOTFS"/{opt,usr/bin,bin,etc/ssl/certs,usr/lib/ssl,root,proc,sys,dev,run,tmp,var/tmp}
chmod 1777 "$ROOTFS/tmp" "$ROOTFS/var/tmp"
chmod 700 "$ROOTFS/root"
cp -al "$DIST/dedloc" "$ROOTFS/opt/$NAME"  # hard links: no second copy on disk
# Qt itself and its bindings' modules: the tray app runs on Windows. PySide6's package stays, so a
# library that probes for it at import gets an ImportError for QtCore, not a failing PySide6.
rm -rf "$ROOTFS/opt/$NAME/_internal/PySide6/Qt"
find "$ROOTFS/opt/$NAME/_internal/PySide6" -name '*.so*' -delete
ln -s "../../opt/$NAME/dedloc" "$ROOTFS/usr/bin/dedloc"
cp -L /bin/sh "$ROOTFS/bin/sh"  # WSL runs commands through the default shell

# Every library the bundle's files and the shell load that the bundle does not carry, at its own path
# (the loader's default directories: no ld.so.cache needed), symlinks resolved.
{ find "$ROOTFS/opt" -type f \( -name '*.so*' -o -perm -u+x \) -print0 | xargs -0 ldd 2>/dev/null || true
  ldd "$ROOTFS/bin/sh"; } \
    | grep -o '/[^ ]*' | grep -v "^$ROOTFS/" | sort -u | while read -r lib; do
        [ -e "$lib" ] && cp -L --parents "$lib" "$ROOTFS"
    done
[ -x "$ROOTFS/lib64/ld-linux-x86-64.so.2" ] || [ "$MACHINE" != x86_64 ] \
    || { echo "no dynamic loader in $ROOTFS/lib64" >&2; exit 1; }

cp -L /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
ln -s /etc/ssl/certs "$ROOTFS/usr/lib/ssl/certs"  # OpenSSL's default paths
ln -s /etc/ssl/certs/ca-certificates.crt "$ROOTFS/usr/lib/ssl/cert.pem"
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$ROOTFS/etc/passwd"
printf 'root:x:0:\n' > "$ROOTFS/etc/group"
printf 'hosts: files dns\n' > "$ROOTFS/etc/nsswitch.conf"
cat > "$ROOTFS/etc/wsl.conf" <<'CONF'
# The DeDLOC Volunteer worker's distro: the tray app on Windows starts `dedloc worker` here.
[user]
default=root
[boot]
systemd=false
[interop]
appendWindowsPath=false
CONF
cat > "$ROOTFS/etc/os-release" <<RELEASE
NAME="DeDLOC Volunteer worker"
ID=dedloc-volunteer
VERSION_ID=$VERSION
PRETTY_NAME="DeDLOC Volunteer worker $VERSION"
RELEASE

TAR="$DIST/$NAME-$VERSION-wsl-$MACHINE.tar.gz"
GZ="gzip -$TAR_GZIP_LEVEL"
command -v pigz >/dev/null && GZ="pigz -$TAR_GZIP_LEVEL"
tar -C "$ROOTFS" --numeric-owner --owner=0 --group=0 -cf - . | $GZ > "$TAR"
rm -rf "$STAGE"
echo "wsl: $TAR ($(du -sh "$TAR" | cut -f1)) in $(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f s", b - a }')"
