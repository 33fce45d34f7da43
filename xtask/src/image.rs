//! `cargo xtask image`: the agent's OCI image, built without a daemon and
//! without pulling anything.
//!
//! One layer on an empty base: the static (musl) agent, whose build script
//! embeds the eBPF object, plus the directories the DaemonSet mounts over.
//! Reproducible: the agent is built from `git archive HEAD` unpacked at a
//! fixed path ([`BUILD_DIR`], unpacked again only for another commit) with a
//! fixed target directory and
//! `--remap-path-prefix`, so no checkout path enters the binary; the layer
//! tar has a fixed order, uid/gid 0, fixed modes and every mtime set to the
//! commit's date (or `SOURCE_DATE_EPOCH`); gzip has no name and no mtime; the
//! JSON documents are written in a fixed order. The same commit gives the
//! same digest.
//!
//! Output, under `<target>/image/`: an OCI image layout `proxy-agent/`
//! (`skopeo copy oci:…`, `umoci unpack --image …`) and `proxy-agent.tar`,
//! the same layout plus Docker's `manifest.json`, which `docker load` and
//! `ctr images import` accept.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::setup;

/// Where the agent is built from a copy of the tracked files (fixed, so
/// that the paths in the binary and in the eBPF object's BTF are too).
pub const BUILD_DIR: &str = "/var/tmp/proxy-agent-image-build";
/// The target the agent is built for: static, no libc needed in the image.
pub const TARGET: &str = "x86_64-unknown-linux-musl";
/// The image's repository name (as `deploy/daemonset.yaml` names it).
pub const NAME: &str = "proxy-agent";
/// Where the binary lives in the image.
pub const BINARY: &str = "usr/local/bin/proxy-agent";

const MT_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MT_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const MT_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// How to build the image.
#[derive(Clone, Debug)]
pub struct ImageOptions {
    /// The tag (`latest`).
    pub tag: String,
    /// Where the layout and the tarball go (`<target>/image`).
    pub out_dir: PathBuf,
    /// The date stamped on files and in the config (seconds since the
    /// epoch); `None`: `SOURCE_DATE_EPOCH`, else the commit's date.
    pub source_date_epoch: Option<u64>,
}

impl Default for ImageOptions {
    fn default() -> Self {
        Self {
            tag: "latest".to_string(),
            out_dir: setup::target_dir().join("image"),
            source_date_epoch: None,
        }
    }
}

/// A built image.
#[derive(Clone, Debug)]
pub struct Image {
    /// The OCI layout directory.
    pub layout: PathBuf,
    /// The tarball (OCI layout + Docker's manifest.json).
    pub tarball: PathBuf,
    /// The manifest's digest, `sha256:<hex>`: the image's identity.
    pub digest: String,
    /// The reference the layout's index names (`latest`).
    pub tag: String,
    /// The commit the agent was built from.
    pub commit: String,
    /// Bytes of the gzipped layer and of the layer's tar.
    pub compressed_size: u64,
    pub uncompressed_size: u64,
}

impl Image {
    /// `oci:<layout>:<tag>`, the reference skopeo and umoci take.
    pub fn oci_ref(&self) -> String {
        format!("{}:{}", self.layout.display(), self.tag)
    }
}

fn git(args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(setup::workspace_root())
        .output()
        .with_context(|| format!("cannot run git {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `SOURCE_DATE_EPOCH` if set, else the commit's date.
fn source_date_epoch() -> Result<u64> {
    if let Ok(s) = std::env::var("SOURCE_DATE_EPOCH") {
        return s
            .trim()
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={s:?} is not a number of seconds"));
    }
    let s = git(&["log", "-1", "--format=%ct", "HEAD"])?;
    s.parse()
        .with_context(|| format!("git log printed {s:?} for the commit date"))
}

/// Unpacks `git archive <commit>` into `<BUILD_DIR>/src` (replacing what was
/// there) and returns that directory.
fn export_source(commit: &str) -> Result<PathBuf> {
    let src = Path::new(BUILD_DIR).join("src");
    // Unpacked already for this commit: unpacking again would give the
    // directories new mtimes, and the build script's rerun-if-changed on the
    // eBPF crate would rebuild the agent for nothing.
    let stamp = Path::new(BUILD_DIR).join("src.commit");
    if src.is_dir() && std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == commit) {
        return Ok(src);
    }
    let _ = std::fs::remove_file(&stamp);
    if src.exists() {
        std::fs::remove_dir_all(&src).with_context(|| format!("remove {}", src.display()))?;
    }
    std::fs::create_dir_all(&src)?;
    let archive = Command::new("git")
        .args(["archive", "--format=tar", commit])
        .current_dir(setup::workspace_root())
        .output()
        .context("cannot run git archive")?;
    if !archive.status.success() {
        bail!(
            "git archive {commit} failed: {}",
            String::from_utf8_lossy(&archive.stderr).trim()
        );
    }
    tar::Archive::new(archive.stdout.as_slice())
        .unpack(&src)
        .with_context(|| format!("unpack the sources into {}", src.display()))?;
    std::fs::write(&stamp, commit)?;
    Ok(src)
}

/// Builds the static agent from `src`; returns the binary.
fn build_agent(src: &Path) -> Result<PathBuf> {
    let target_dir = Path::new(BUILD_DIR).join("target");
    let mut remap = vec![format!(
        "--remap-path-prefix={}=/proxy-agent",
        src.display()
    )];
    if let Some(home) = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
    {
        remap.push(format!("--remap-path-prefix={}=/cargo", home.display()));
    }
    let mut cmd = setup::cargo();
    cmd.current_dir(src)
        .args(["build", "--release", "--locked", "-p", "proxy-agent"])
        .args(["--bin", "proxy-agent", "--target", TARGET])
        .env("CARGO_TARGET_DIR", &target_dir)
        .env("RUSTFLAGS", remap.join(" "))
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        // ring's C code, compiled for musl.
        .env("CC_x86_64_unknown_linux_musl", "musl-gcc");
    setup::run_visible(&mut cmd).context("building the static agent for the image")?;
    let bin = target_dir.join(TARGET).join("release/proxy-agent");
    if !bin.is_file() {
        bail!("the build left no binary at {}", bin.display());
    }
    Ok(bin)
}

fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// One entry of the layer.
enum Entry<'a> {
    Dir(&'a str, u32),
    File(&'a str, u32, &'a [u8]),
}

/// The layer's tar: fixed order, owner 0:0, fixed modes, mtime `mtime`.
fn layer_tar(agent: &[u8], mtime: u64) -> Result<Vec<u8>> {
    // The mount points of the DaemonSet's volumes exist in the image, so a
    // runtime with a read-only root needs to create nothing.
    let entries = [
        Entry::Dir("dev/", 0o755),
        Entry::Dir("etc/", 0o755),
        Entry::Dir("etc/proxy-agent/", 0o755),
        Entry::Dir("proc/", 0o755),
        Entry::Dir("sys/", 0o755),
        Entry::Dir("tmp/", 0o1777),
        Entry::Dir("usr/", 0o755),
        Entry::Dir("usr/local/", 0o755),
        Entry::Dir("usr/local/bin/", 0o755),
        Entry::File(BINARY, 0o755, agent),
    ];
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_ustar();
        h.set_uid(0);
        h.set_gid(0);
        h.set_username("root")?;
        h.set_groupname("root")?;
        h.set_mtime(mtime);
        match e {
            Entry::Dir(path, mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(mode);
                h.set_size(0);
                b.append_data(&mut h, path, std::io::empty())?;
            }
            Entry::File(path, mode, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, path, data)?;
            }
        }
    }
    Ok(b.into_inner()?)
}

/// Gzip with a fixed header: no file name, mtime 0, best compression.
fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::best());
    enc.write_all(data)?;
    Ok(enc.finish()?)
}

/// RFC 3339 in UTC of `secs` since the epoch.
fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A content-addressed blob: its bytes and `sha256:<hex>`.
struct Blob {
    bytes: Vec<u8>,
    hex: String,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Self {
        let hex = sha256_hex(&bytes);
        Self { bytes, hex }
    }
    fn json(v: &Value) -> Result<Self> {
        Ok(Self::new(serde_json::to_vec(v)?))
    }
    fn digest(&self) -> String {
        format!("sha256:{}", self.hex)
    }
    fn path(&self) -> String {
        format!("blobs/sha256/{}", self.hex)
    }
    fn descriptor(&self, media_type: &str) -> Value {
        json!({"mediaType": media_type, "digest": self.digest(), "size": self.bytes.len()})
    }
}

/// The image's files: (path in the layout, bytes), in a fixed order.
struct Assembled {
    files: Vec<(String, Vec<u8>)>,
    digest: String,
    compressed: u64,
    uncompressed: u64,
}

/// Assembles the layout's files from the agent binary.
fn assemble(agent: &[u8], tag: &str, commit: &str, epoch: u64) -> Result<Assembled> {
    let tar = layer_tar(agent, epoch)?;
    let diff_id = format!("sha256:{}", sha256_hex(&tar));
    let layer = Blob::new(gzip(&tar)?);
    let created = rfc3339(epoch);
    let labels = json!({
        "org.opencontainers.image.revision": commit,
        "org.opencontainers.image.title": NAME,
    });
    let config = Blob::json(&json!({
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": [format!("/{BINARY}")],
            "Cmd": ["run", "--source", "kubernetes", "--config", "/etc/proxy-agent/config.yaml"],
            "Env": ["PATH=/usr/local/bin"],
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": created, "created_by": "cargo xtask image"}],
    }))?;
    let manifest = Blob::json(&json!({
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": config.descriptor(MT_CONFIG),
        "layers": [layer.descriptor(MT_LAYER)],
        "annotations": {
            "org.opencontainers.image.created": created,
            "org.opencontainers.image.revision": commit,
        },
    }))?;
    let mut m = manifest.descriptor(MT_MANIFEST);
    m["platform"] = json!({"architecture": "amd64", "os": "linux"});
    m["annotations"] = json!({
        // containerd's name for the image (`ctr images import`), the one the
        // DaemonSet's `image: proxy-agent:latest` resolves to.
        "io.containerd.image.name": format!("docker.io/library/{NAME}:{tag}"),
        "org.opencontainers.image.ref.name": tag,
    });
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MT_INDEX,
        "manifests": [m],
    }))?;
    let docker = serde_json::to_vec(&json!([{
        "Config": config.path(),
        "RepoTags": [format!("{NAME}:{tag}")],
        "Layers": [layer.path()],
    }]))?;
    let digest = manifest.digest();
    let (compressed, uncompressed) = (layer.bytes.len() as u64, tar.len() as u64);
    let files = vec![
        (
            "oci-layout".to_string(),
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
        ),
        ("index.json".to_string(), index),
        ("manifest.json".to_string(), docker),
        (config.path(), config.bytes),
        (layer.path(), layer.bytes),
        (manifest.path(), manifest.bytes),
    ];
    Ok(Assembled {
        files,
        digest,
        compressed,
        uncompressed,
    })
}

/// Writes the layout directory and the tarball.
fn write_out(a: &Assembled, layout: &Path, tarball: &Path, epoch: u64) -> Result<()> {
    if layout.exists() {
        std::fs::remove_dir_all(layout).with_context(|| format!("remove {}", layout.display()))?;
    }
    std::fs::create_dir_all(layout.join("blobs/sha256"))?;
    for (path, bytes) in &a.files {
        // manifest.json is Docker's, for the tarball only.
        if path != "manifest.json" {
            std::fs::write(layout.join(path), bytes)
                .with_context(|| format!("write {}", layout.join(path).display()))?;
        }
    }
    let mut b = tar::Builder::new(Vec::new());
    let dirs = ["blobs/", "blobs/sha256/"];
    let mut entries: Vec<(&str, Option<&[u8]>)> = dirs.iter().map(|d| (*d, None)).collect();
    entries.extend(
        a.files
            .iter()
            .map(|(p, b)| (p.as_str(), Some(b.as_slice()))),
    );
    for (path, data) in entries {
        let mut h = tar::Header::new_ustar();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(epoch);
        match data {
            None => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, path, std::io::empty())?;
            }
            Some(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(d.len() as u64);
                b.append_data(&mut h, path, d)?;
            }
        }
    }
    std::fs::write(tarball, b.into_inner()?)
        .with_context(|| format!("write {}", tarball.display()))?;
    Ok(())
}

/// Builds the image (setup first); see the module's documentation.
pub fn build(opts: &ImageOptions) -> Result<Image> {
    setup::ensure_datapath_setup()?;
    let commit = git(&["rev-parse", "HEAD"])?;
    if !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty() {
        eprintln!("warning: the work tree has uncommitted changes; the image is built from HEAD ({commit}) without them");
    }
    let epoch = match opts.source_date_epoch {
        Some(e) => e,
        None => source_date_epoch()?,
    };
    let src = export_source(&commit)?;
    let bin = build_agent(&src)?;
    let agent = std::fs::read(&bin).with_context(|| format!("read {}", bin.display()))?;
    let a = assemble(&agent, &opts.tag, &commit, epoch)?;
    std::fs::create_dir_all(&opts.out_dir)?;
    let layout = opts.out_dir.join(NAME);
    let tarball = opts.out_dir.join(format!("{NAME}.tar"));
    write_out(&a, &layout, &tarball, epoch)?;
    Ok(Image {
        layout,
        tarball,
        digest: a.digest.clone(),
        tag: opts.tag.clone(),
        commit,
        compressed_size: a.compressed,
        uncompressed_size: a.uncompressed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn assembly_is_deterministic_and_content_addressed() {
        let a = assemble(b"binary", "latest", "c0ffee", 1_700_000_000).unwrap();
        let b = assemble(b"binary", "latest", "c0ffee", 1_700_000_000).unwrap();
        assert_eq!(a.digest, b.digest);
        assert_eq!(a.files, b.files);
        for (path, bytes) in &a.files {
            if let Some(hex) = path.strip_prefix("blobs/sha256/") {
                assert_eq!(hex, sha256_hex(bytes), "{path}");
            }
        }
        let later = assemble(b"binary", "latest", "c0ffee", 1_700_000_001).unwrap();
        assert_ne!(a.digest, later.digest, "the date is part of the image");
    }
}
