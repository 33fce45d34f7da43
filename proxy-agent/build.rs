//! Builds `proxy-ebpf` for the BPF target with aya-build and leaves the object in
//! `OUT_DIR`, where `src/bpf.rs` embeds it. `AYA_BUILD_SKIP=1` skips the kernel
//! build (for `cargo check` and clippy on machines without bpf-linker).
fn main() -> anyhow::Result<()> {
    // aya-build watches the eBPF crate's own directory only: a change in
    // `proxy-common` (map layouts, conntrack rules, checksums the programs
    // compile in) would otherwise leave a stale object embedded.
    println!(
        "cargo:rerun-if-changed={}",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../proxy-common")
    );
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "proxy-ebpf",
            root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../proxy-ebpf"),
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
