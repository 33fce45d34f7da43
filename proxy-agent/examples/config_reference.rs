//! Writes the configuration file's reference page, rendered from the config
//! types (`proxy_agent::config_reference`): `cargo xtask docs` runs
//! `cargo run -p proxy-agent --example config_reference -- docs/configuration.md`.
//! Without an argument the page goes to stdout. Fails, naming them, when a
//! field or enum value has no doc comment.

fn main() {
    let page = match proxy_agent::config_reference::markdown() {
        Ok(page) => page,
        Err(missing) => {
            eprintln!("fields or values without a doc comment: {missing:?}");
            std::process::exit(1);
        }
    };
    match std::env::args_os().nth(1) {
        Some(path) => std::fs::write(&path, page).unwrap_or_else(|e| {
            eprintln!("cannot write {}: {e}", path.to_string_lossy());
            std::process::exit(1);
        }),
        None => print!("{page}"),
    }
}
