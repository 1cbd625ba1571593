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

# archive_platforms <OCI archive>: "<architecture> <digest>" of each image in the archive's image
# index (build/images writes one index per archive), one per line; fails, printing nothing, when
# the archive holds no index with platforms. The digests are the same in a registry the archive
# was pushed to whole (skopeo copy --all --preserve-digests). In an index each entry gives its
# digest before its platform.
archive_platforms() {
  skopeo inspect --raw "oci-archive:$1" 2>/dev/null |
    grep -o '"digest": *"sha256:[0-9a-f]\{64\}"\|"architecture": *"[a-z0-9]*"' |
    awk -F'"' '$2 == "digest" { d = $4 } $2 == "architecture" { print $4, d; n++ } END { exit !n }'
}
