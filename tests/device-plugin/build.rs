//! Compiles `proto/v1beta1/deviceplugin.proto` (our own wire-compatible description of the
//! kubelet's device-plugin API) with `protox`, a pure-Rust protobuf compiler, so no `protoc`
//! binary is needed, and generates the tonic servers and clients with `tonic-prost-build`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/v1beta1/deviceplugin.proto");
    let fds = protox::compile(["v1beta1/deviceplugin.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // No generated `connect` helper: we connect over unix sockets with our own connector.
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
