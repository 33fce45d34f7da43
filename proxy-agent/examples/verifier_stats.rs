//! What the kernel's verifier says of each program (root): instructions it
//! processed, and the program's size after translation and JIT. The split of
//! the datapath into modules, a new kernel or a new toolchain must not make
//! these grow unnoticed.
//!
//! `cargo run --release -p proxy-agent --example verifier_stats -- [OBJECT]`
//! loads the embedded object (or the eBPF object file given) with maps of
//! their default sizes, unpinned, and prints one line per program.
use aya::{
    programs::{Program, ProgramInfo},
    Ebpf,
};

fn main() -> anyhow::Result<()> {
    let file;
    let bytes: &[u8] = match std::env::args().nth(1) {
        Some(path) => {
            file = std::fs::read(&path)?;
            &file
        }
        None => proxy_agent::bpf::EBPF_OBJECT,
    };
    let mut ebpf = Ebpf::load(bytes)?;
    let names: Vec<String> = ebpf.programs().map(|(n, _)| n.to_owned()).collect();
    println!("kernel {}", kernel_release());
    let mut failed = 0;
    for name in names {
        let prog = ebpf.program_mut(&name).expect("listed");
        let loaded = match prog {
            Program::SchedClassifier(p) => p.load().and_then(|()| p.info()),
            Program::Xdp(p) => p.load().and_then(|()| p.info()),
            _ => continue,
        };
        match loaded {
            Ok(info) => print_info(&name, &info),
            Err(e) => {
                failed += 1;
                println!("{name:<12} REFUSED: {e:#}");
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} program(s) refused by the verifier");
    }
    Ok(())
}

fn print_info(name: &str, info: &ProgramInfo) {
    let show = |v: Option<u32>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
    println!(
        "{name:<12} verified_insns {:>6}  xlated {:>6} B  jited {:>6} B",
        show(info.verified_instruction_count()),
        show(info.size_translated()),
        info.size_jitted(),
    );
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".to_owned())
}
