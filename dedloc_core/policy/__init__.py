"""Whether to contribute now, and within which limits.

The code is organized as follows:

- ``rules``: ``decide(inputs, prefs)``, the pure contribution policy (no clock, no I/O).
- ``sampler``: samples the machine (idle time, battery, other programs' CPU and GPU use).
- ``contributor``: turns decisions over time into worker actions (start, pause, resume, release).
- ``hardware``: what this computer has (CPU, RAM, disk, NVIDIA GPUs) against an experiment's minimums.
- ``idle``: seconds since the last user input, per desktop (X11, GNOME, KDE, logind, Windows, macOS).

A light room: the tray app runs it on its timer. Never torch or hivemind.
"""
