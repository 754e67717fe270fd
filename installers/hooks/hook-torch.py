"""torch for PyInstaller, replacing the contributed hook to leave out what a CPU training worker
never loads: the C++ headers, tests and test binaries, and the test-only Python packages.

The shared libraries (torch/lib), ``torch_shm_manager`` (torch's ``file_system`` sharing strategy
starts it; the worker uses ``file_descriptor``, but a plain hivemind run uses the default) and the
Python sources (TorchScript compiles from them) stay.
"""
# $PyInstaller-Hook-Priority: 100

import os

from PyInstaller.utils.hooks import (
    PY_DYLIB_PATTERNS,
    collect_data_files,
    collect_dynamic_libs,
    collect_submodules,
    get_package_paths,
)

_SKIP_MODULES = (
    "torch.testing._internal",
    "torch.utils.benchmark",
    "torch.utils.tensorboard",
    "torch.utils.bottleneck",
    "torch.utils.hipify",
    "torch.onnx",
    "torch._inductor.codegen.cuda",
    "torch._inductor.kernel",
    "torch.distributed.elastic",
    "torch.distributed.pipelining",
    "torch._export.serde",
    "torch.contrib",
    "torch.test",
)

module_collection_mode = "pyz+py"
warn_on_missing_hiddenimports = False
hiddenimports = collect_submodules("torch", filter=lambda name: not name.startswith(_SKIP_MODULES))
datas = collect_data_files(
    "torch",
    excludes=["**/*.h", "**/*.hpp", "**/*.cuh", "**/*.lib", "**/*.cpp", "**/*.pyi", "**/*.cmake",
              "include/**", "test/**", "bin/**", "share/**", "testing/_internal/**", "**/*.a"],
)
binaries = collect_dynamic_libs("torch", search_patterns=PY_DYLIB_PATTERNS + ["*.so.*"])
binaries = [(src, dest) for src, dest in binaries if "/bin/" not in src.replace(os.sep, "/")]
binaries.append((os.path.join(get_package_paths("torch")[1], "bin", "torch_shm_manager"), "torch/bin"))
bindepend_symlink_suppression = ["**/torch/lib/*.so*"]
