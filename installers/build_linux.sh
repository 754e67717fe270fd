#!/usr/bin/env bash
# Build the Linux packages into dist/ in one go:
#   dist/dedloc/dedloc                               the one-folder bundle (PyInstaller)
#   dist/dedloc-volunteer_VERSION_ARCH.deb           installs it under /opt/dedloc-volunteer, with a
#                                                    launcher, an icon and /usr/bin/dedloc
#   dist/dedloc-volunteer-VERSION-linux-MACHINE.tar.gz   the bundle as an archive
#   dist/dedloc-volunteer-VERSION-wsl-MACHINE.tar.gz     the WSL2 distro of the worker (build_wsl.sh)
# Usage: installers/build_linux.sh [--no-bundle]   (--no-bundle: package an existing dist/dedloc)
# Environment: PYTHON (default .venv/bin/python), DEB_COMPRESSION (default zstd; xz for smaller
# release files, gzip for dpkg older than 1.21.18), TAR_GZIP_LEVEL (default 1: fast).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEB_COMPRESSION=${DEB_COMPRESSION:-zstd}
TAR_GZIP_LEVEL=${TAR_GZIP_LEVEL:-1}
NAME=dedloc-volunteer
PREFIX=/opt/$NAME
VERSION=$("$PY" -c 'import dedloc_core; print(dedloc_core.__version__)')
ARCH=$(dpkg --print-architecture 2>/dev/null || echo amd64)
MACHINE=$(uname -m)
DIST=dist
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
size() { du -sh "$1" | cut -f1; }

if [ "${1:-}" != "--no-bundle" ]; then
    t=$(now)
    rm -rf "$DIST/dedloc"
    "$PY" -m PyInstaller --noconfirm --log-level WARN --distpath "$DIST" --workpath build/pyinstaller \
        installers/dedloc.spec
    # Drop the symbol tables of the shared libraries (libtorch_cpu.so alone carries 90 MB). Not:
    # the executable (its archive of Python modules is appended to it), libraries that auditwheel
    # rewrote with patchelf (*.libs/: stripped, they no longer load), nor Qt's (little to gain).
    find "$DIST/dedloc/_internal" -type f -name '*.so*' -not -path '*.libs/*' -not -path '*/PySide6/*' \
        -print0 | xargs -0 -r strip --strip-unneeded
    echo "bundle: $DIST/dedloc ($(size "$DIST/dedloc")) in $(took "$t")"
fi
[ -x "$DIST/dedloc/dedloc" ] || { echo "No bundle at $DIST/dedloc/dedloc: build it first." >&2; exit 1; }

# ---- .deb ------------------------------------------------------------------------------------
t=$(now)
STAGE=build/deb/$NAME
rm -rf build/deb && mkdir -p "$STAGE/DEBIAN" "$STAGE/opt" "$STAGE/usr/bin" "$STAGE/usr/share/applications"
cp -al "$DIST/dedloc" "$STAGE$PREFIX"  # hard links: no second copy of a GB on disk
ln -s "../../opt/$NAME/dedloc" "$STAGE/usr/bin/dedloc"  # relative, so it also works in a scratch root
"$PY" -c "from dedloc_core.autostart import desktop_entry; print(desktop_entry(['$PREFIX/dedloc', 'app'], url_handler=True), end='')" \
    > "$STAGE/usr/share/applications/$NAME.desktop"
for png in resources/icons/$NAME-*.png; do
    n=${png##*-}; n=${n%.png}
    install -D -m 644 "$png" "$STAGE/usr/share/icons/hicolor/${n}x${n}/apps/$NAME.png"
done
install -D -m 644 "resources/icons/$NAME.svg" "$STAGE/usr/share/icons/hicolor/scalable/apps/$NAME.svg"
# The oldest glibc the bundle runs on: the newest GLIBC_ symbol version any of its files asks for.
GLIBC=$({ find "$DIST/dedloc" -type f \( -name '*.so*' -o -perm -u+x \) -print0 \
    | xargs -0 objdump -T 2>/dev/null || true; } | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
cat > "$STAGE/DEBIAN/control" <<CONTROL
Package: $NAME
Version: $VERSION
Architecture: $ARCH
Maintainer: DeDLOC Volunteer project <dedloc-volunteer@users.noreply.github.com>
Installed-Size: $(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
Depends: libc6 (>= ${GLIBC:-2.28}), libgl1, libegl1, libfontconfig1, libxkbcommon0, libdbus-1-3, libglib2.0-0
Recommends: libxcb-cursor0, libxkbcommon-x11-0, libxcb-icccm4, libxcb-image0, libxcb-keysyms1, libxcb-randr0, libxcb-render-util0, libxcb-shape0, libxcb-xinerama0, libxcb-xkb1, libxss1, libxi6
Section: science
Priority: optional
Homepage: https://github.com/learning-at-home/hivemind
Description: lend your computer to collaborative deep-learning training
 DeDLOC Volunteer is a tray app that joins open, collaborative deep-learning
 training runs (hivemind / DeDLOC) when the computer is idle, within the
 CPU, GPU and network limits you set. Run "dedloc --self-test" to check it.
CONTROL
for script in postinst postrm; do
    cat > "$STAGE/DEBIAN/$script" <<'SCRIPT'
#!/bin/sh
set -e
command -v update-desktop-database >/dev/null && update-desktop-database -q /usr/share/applications || true
command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -t /usr/share/icons/hicolor || true
SCRIPT
    chmod 755 "$STAGE/DEBIAN/$script"
done
DEB="$DIST/${NAME}_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Z"$DEB_COMPRESSION" --build "$STAGE" "$DEB" >/dev/null
rm -rf build/deb
echo "deb: $DEB ($(size "$DEB"), $DEB_COMPRESSION) in $(took "$t")"

# ---- .tar.gz ---------------------------------------------------------------------------------
t=$(now)
TGZ="$DIST/$NAME-$VERSION-linux-$MACHINE.tar.gz"
GZ="gzip -$TAR_GZIP_LEVEL"
command -v pigz >/dev/null && GZ="pigz -$TAR_GZIP_LEVEL"
tar -C "$DIST" --owner=0 --group=0 -cf - dedloc | $GZ > "$TGZ"
echo "tar.gz: $TGZ ($(size "$TGZ")) in $(took "$t")"

# ---- the WSL2 distro (the Windows app's worker) ------------------------------------------------
PYTHON="$PY" TAR_GZIP_LEVEL="$TAR_GZIP_LEVEL" bash installers/build_wsl.sh
