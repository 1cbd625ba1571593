# The two entry points a new user needs; everything else is cargo.
.PHONY: demo test lint crds images

# The local demo: a cold request wakes a scaled-to-zero model.
demo:
	tests/demo

# Every test: start the local control plane, run cargo test --workspace, stop it.
test:
	tests/run-tests

# The lint gate CI runs before the tests.
lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# Regenerate crds/*.yaml from the API types.
crds:
	cargo run -p hearth-crds --example crdgen

# Hearth's container images as OCI archives in target/images, without an engine or a registry.
images:
	build/images
