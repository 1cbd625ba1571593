//! Compiles `proto/externalscaler.proto` with `protox` (a pure-Rust protobuf compiler, so no
//! `protoc` binary is needed) and generates the tonic server and client with `tonic-prost-build`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/externalscaler.proto");
    let fds = protox::compile(["externalscaler.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // No generated `connect` helper: it would need tonic's `channel` feature in the library.
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
