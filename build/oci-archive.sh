# shellcheck shell=bash
# Helpers for the OCI image archives build/images writes, shared by build/push and the local
# cluster's load-images (tests/cluster/lib/images.sh). Sourced, never executed.

# archive_ref <OCI archive>: the image reference its index.json names
# (org.opencontainers.image.ref.name); fails, printing nothing, when it names none or is not an
# archive.
archive_ref() {
  tar -xOf "$1" index.json 2>/dev/null |
    grep -o '"org.opencontainers.image.ref.name":"[^"]*"' | head -n 1 | cut -d'"' -f4 | grep .
}
