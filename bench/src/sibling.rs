//! Where the `bench` binaries find `bagstore`.

/// The harness finds `bagstore` next to a test binary's `deps/` directory;
/// a bench binary lives in `target/<profile>/` itself, so point it at the
/// sibling explicitly (unless `BAGSTORE_BIN` says otherwise).
pub fn locate_bagstore() -> Result<(), String> {
    if std::env::var_os("BAGSTORE_BIN").is_some() {
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let bin = exe.with_file_name("bagstore");
    if !bin.exists() {
        return Err(format!("{} is missing: run `cargo build -p bagstore` first", bin.display()));
    }
    std::env::set_var("BAGSTORE_BIN", &bin);
    Ok(())
}
