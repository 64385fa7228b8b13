fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc keeps a fresh machine free of an apt step.
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing else reads the environment now.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    tonic_prost_build::configure().compile_protos(&["strata.proto"], &["."])?;
    println!("cargo:rerun-if-changed=strata.proto");
    Ok(())
}
