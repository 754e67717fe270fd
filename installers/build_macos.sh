#!/usr/bin/env bash
# macOS recipe (run on a Mac; not run by CI, which is Linux): builds
#   dist/DeDLOC Volunteer.app                          the app bundle (tray app + worker + CLI)
#   dist/dedloc-volunteer-VERSION-macos-ARCH.dmg       a disk image with the app and an Applications link
# Needs: Xcode command line tools (iconutil, codesign, hdiutil) and a venv made with `make setup`
# (hivemind's macOS wheel carries a darwin p2pd). Status: see README "Platforms" (partial).
# Signing: ad hoc by default (runs on the machine that built it; Gatekeeper warns elsewhere). Set
# CODESIGN_IDENTITY="Developer ID Application: ..." to sign for distribution, then notarize with
# `xcrun notarytool submit dist/*.dmg --wait` and `xcrun stapler staple dist/*.dmg`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=$("$PY" -c 'import dedloc_core; print(dedloc_core.__version__)')
ARCH=$(uname -m)
APP="dist/DeDLOC Volunteer.app"

# The icon: an .icns made from the committed PNGs.
ICONSET=build/dedloc-volunteer.iconset
rm -rf "$ICONSET" && mkdir -p "$ICONSET"
for n in 16 32 128 256 512; do
    cp "resources/icons/dedloc-volunteer-$n.png" "$ICONSET/icon_${n}x${n}.png"
done
for n in 16 128 256; do
    cp "resources/icons/dedloc-volunteer-$((n * 2)).png" "$ICONSET/icon_${n}x${n}@2x.png"
done
iconutil -c icns "$ICONSET" -o build/dedloc-volunteer.icns

# The spec makes the .app on macOS (BUNDLE step): LSUIElement, so it lives in the menu bar only.
DEDLOC_VERSION=$VERSION "$PY" -m PyInstaller --noconfirm --log-level WARN --distpath dist \
    --workpath build/pyinstaller installers/dedloc.spec
codesign --force --deep --timestamp=none --sign "${CODESIGN_IDENTITY:--}" "$APP"
"$APP/Contents/MacOS/dedloc" --self-test

STAGE=build/dmg
rm -rf "$STAGE" && mkdir -p "$STAGE"
cp -R "$APP" "$STAGE/"
ln -s /Applications "$STAGE/Applications"
DMG="dist/dedloc-volunteer-$VERSION-macos-$ARCH.dmg"
hdiutil create -volname "DeDLOC Volunteer" -srcfolder "$STAGE" -ov -format UDZO "$DMG"
echo "app: $APP; dmg: $DMG ($(du -sh "$DMG" | cut -f1))"
