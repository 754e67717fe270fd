"""hivemind for PyInstaller: its submodules (the multiaddr codecs are imported by name), its .proto
and config files, the p2pd binary, and the .py sources (TorchScript reads them at run time)."""

import os

from PyInstaller.utils.hooks import collect_data_files, collect_submodules, get_package_paths

hiddenimports = collect_submodules("hivemind", filter=lambda name: ".tests" not in name)
datas = collect_data_files("hivemind", includes=["**/*.proto", "**/*.yml", "**/*.yaml"])
_p2pd = os.path.join(get_package_paths("hivemind")[1], "hivemind_cli", "p2pd")
binaries = [(_p2pd, "hivemind/hivemind_cli")]
module_collection_mode = "pyz+py"
