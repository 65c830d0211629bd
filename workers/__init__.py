"""Worker processes of one rank (capture, commit, maintenance); see issue 4."""
