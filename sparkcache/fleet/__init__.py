"""The shared tier: pages copied to a Redis Cluster that every node of a fleet reads
through, so a conversation's next turn restores on whichever node serves it
(docs/fleet.md). ``cluster`` connects (credentials from the environment or a file, TLS,
a key prefix per deployment); ``codec`` frames a page so a read verifies it like a local
one; ``pages`` shares pages once fleet-wide and fetches a verified prefix, pipelined."""
