"""Files shipped with the app: default catalog, trusted keys, corpus, icons. Read them with
``dedloc_core.paths.resource``, never with paths computed from the source tree."""
