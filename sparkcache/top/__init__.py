"""``sparkcache top``: a live terminal view of a running instance. ``gather`` takes a
frame (dataclasses), ``render`` draws it with rich, ``live`` refreshes it in place and
reads keys, ``command`` is what the CLI runs."""
