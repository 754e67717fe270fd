"""The ``resources`` package's files (catalog, trusted keys, corpus, icons), read at run time with
importlib.resources."""

from PyInstaller.utils.hooks import collect_data_files

datas = collect_data_files("resources", excludes=["**/__pycache__/**", "**/*.py"])
