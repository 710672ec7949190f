"""Files that appear whole or not at all, never follow a link, and run no code when read.

May import: common, config.

Atomic writes, the one door to a results folder (``outdir``), content digests, the code-free tree format,
checkpoints and their checks against the run they would resume, and the asynchronous engine's messages in
that format: everything a run leaves on disk besides its tables goes through here, so a damaged or
hostile file is refused with one line, never executed.
"""
