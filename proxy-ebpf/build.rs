// Rebuild when bpf-linker changes (aya-template does the same).
fn main() {
    if let Ok(p) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}
