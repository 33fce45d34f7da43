//! YAML and JSON documents into typed objects: split, depth-checked,
//! dispatched by kind, validated; a bad document is an error of its own.

use std::fmt;
use std::path::Path;

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::de::DeserializeOwned;
use yaml_serde::Value;

use super::{ManifestError, ObjectRef, Sink};

/// Loads the documents of `text` (read from `path`, used in errors) into `snapshot`.
pub fn load_str<S: Sink>(
    path: &Path,
    text: &str,
    snapshot: &mut S,
    errors: &mut Vec<ManifestError>,
) {
    // A byte-order mark may start the file, or a line of it where files
    // were joined (`cat a.yaml b.yaml`); the YAML parser takes neither.
    let unmarked: String;
    let text = if text.contains('\u{feff}') {
        unmarked = text
            .split_inclusive('\n')
            .map(|l| l.strip_prefix('\u{feff}').unwrap_or(l))
            .collect();
        &unmarked
    } else {
        text
    };
    let docs = split_documents(text);
    // Many documents (a generated file of thousands of Services) are read
    // on every CPU, in chunks whose objects and errors are then put in
    // document order: each document is read alone.
    let threads = crate::parallel::threads();
    if threads < 2 || docs.len() < PARALLEL_DOCUMENTS {
        for (index, (first_line, doc)) in docs.into_iter().enumerate() {
            load_document(path, index + 1, first_line, doc, snapshot, errors);
        }
        return;
    }
    let chunk = docs.len().div_ceil(threads);
    let parts: Vec<_> = docs
        .chunks(chunk)
        .enumerate()
        .map(|(c, part)| {
            move || {
                let mut sink = S::default();
                let mut errors = Vec::new();
                for (i, (first_line, doc)) in part.iter().enumerate() {
                    let index = c * chunk + i + 1;
                    load_document(path, index, *first_line, doc, &mut sink, &mut errors);
                }
                (sink, errors)
            }
        })
        .collect();
    let parts = crate::parallel::map_parts(parts);
    for (sink, errs) in parts {
        snapshot.append(sink);
        errors.extend(errs);
    }
}

/// Files with at least this many documents are read on several threads.
const PARALLEL_DOCUMENTS: usize = 2_048;

/// Loads one document of `path` (1-based `index`, starting at line
/// `first_line` of the file) into `snapshot`.
fn load_document<S: Sink>(
    path: &Path,
    index: usize,
    first_line: usize,
    doc: &str,
    snapshot: &mut S,
    errors: &mut Vec<ManifestError>,
) {
    let err = |object: Option<ObjectRef>, message: String| ManifestError {
        file: path.to_path_buf(),
        document: Some(index),
        object,
        message,
        duplicate: false,
    };
    // A JSON document (what generators write) is parsed as JSON, several
    // times faster; anything it cannot take goes the YAML way, whose
    // errors name the field.
    if load_json(doc, snapshot) {
        return;
    }
    if let Some(line) = too_deep(doc) {
        errors.push(err(
            None,
            format!(
                "line {}: brackets nested more than {MAX_FLOW_DEPTH} levels deep",
                line + first_line
            ),
        ));
        return;
    }
    let value: Value = match yaml_serde::from_str(doc) {
        Ok(v) => v,
        Err(e) => {
            errors.push(err(None, yaml_message(&e, first_line)));
            return;
        }
    };
    if value.is_null() {
        return;
    }
    let object = object_ref(&value);
    if !value.is_mapping() {
        errors.push(err(
            None,
            "not a mapping (an object needs apiVersion and kind)".into(),
        ));
        return;
    }
    let (Some(api_version), Some(kind)) =
        (str_field(&value, "apiVersion"), str_field(&value, "kind"))
    else {
        errors.push(err(Some(object), "missing apiVersion or kind".into()));
        return;
    };
    if (api_version, kind) == ("v1", "List") {
        let items = match value.get("items") {
            None | Some(Value::Null) => return,
            Some(Value::Sequence(items)) => items,
            Some(_) => {
                errors.push(err(Some(object), "items: expected a sequence".into()));
                return;
            }
        };
        for (i, item) in items.iter().enumerate() {
            let result = yaml_serde::to_string(item)
                .map_err(|e| e.to_string())
                .and_then(|text| dispatch(item, &text, snapshot));
            if let Err(message) = result {
                errors.push(err(
                    Some(object_ref(item)),
                    format!("items[{i}]: {message}"),
                ));
            }
        }
        return;
    }
    if let Err(message) = dispatch(&value, doc, snapshot) {
        errors.push(err(Some(object), message));
    }
}

/// Flow collections (`[...]`, `{...}`) nested deeper than this refuse the
/// document before the YAML parser sees it. The parser refuses anything past
/// 128 levels anyway, but its scanner reads all of a flow collection's
/// nesting first, in time that grows with the square of the depth: a
/// 200 kB document of brackets took it 12 s.
const MAX_FLOW_DEPTH: usize = 1_000;

/// The 1-based line (within `doc`) where its brackets open a level past
/// [`MAX_FLOW_DEPTH`], if they do. The count is rough, never a parse: it
/// takes the deeper of two counts, one that skips brackets in quoted strings
/// and comments (a quote counts as opening a string only where a quoted
/// value can begin: at the start of a line or after whitespace, `[`, `{`,
/// `,`, or a `:` closing a quoted key), and one that skips nothing, so that
/// an odd quote in a plain value (`o'brien`) or a bracket in a quoted string
/// hides no nesting from both. A bracket in a plain or block scalar counts
/// too, so the limit is far above any real object's nesting.
fn too_deep(doc: &str) -> Option<usize> {
    let (mut depth, mut raw, mut line) = (0usize, 0usize, 1usize);
    let mut quote: Option<u8> = None;
    let (mut comment, mut escaped) = (false, false);
    // The byte before this one, and the one before that.
    let (mut previous, mut before) = (b'\n', b'\n');
    for &b in doc.as_bytes() {
        match b {
            b'[' | b'{' => raw += 1,
            b']' | b'}' => raw = raw.saturating_sub(1),
            _ => {}
        }
        if b == b'\n' {
            line += 1;
            comment = false;
        } else if comment {
        } else if let Some(q) = quote {
            match b {
                _ if escaped => escaped = false,
                b'\\' if q == b'"' => escaped = true,
                _ if b == q => quote = None,
                _ => {}
            }
        } else {
            match b {
                b'"' | b'\'' if opens_quoted(previous, before) => quote = Some(b),
                b'#' if previous.is_ascii_whitespace() => comment = true,
                b'[' | b'{' => depth += 1,
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        if depth.max(raw) > MAX_FLOW_DEPTH {
            return Some(line);
        }
        (before, previous) = (previous, b);
    }
    None
}

/// Whether a quote after `previous` (after `before`) can open a quoted
/// value: at the start of a line or after whitespace, a flow collection's
/// `[`, `{` or `,`, or the `:` of a quoted key (`{"a":"b"}`).
fn opens_quoted(previous: u8, before: u8) -> bool {
    match previous {
        b'[' | b'{' | b',' => true,
        b':' => matches!(before, b'"' | b'\''),
        _ => previous.is_ascii_whitespace(),
    }
}

/// A syntax error's message with its line numbers (relative to the
/// document) made relative to the file.
fn yaml_message(e: &yaml_serde::Error, first_line: usize) -> String {
    let text = e.to_string();
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("line ") {
        let (before, after) = rest.split_at(at + "line ".len());
        out.push_str(before);
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        match after[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&(n + first_line).to_string()),
            Err(_) => out.push_str(&after[..digits]),
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// The error's message without its `at line L column C` suffix.
fn strip_location(e: &yaml_serde::Error) -> String {
    let text = e.to_string();
    if let Some(loc) = e.location() {
        let suffix = format!(" at line {} column {}", loc.line(), loc.column());
        if let Some(stripped) = text.strip_suffix(&suffix) {
            return stripped.to_string();
        }
    }
    text
}

/// Routes one object to its list in `snapshot` by apiVersion/kind, after
/// validation. Unknown kinds are skipped.
fn dispatch(value: &Value, text: &str, snapshot: &mut impl Sink) -> Result<(), String> {
    let api_version = str_field(value, "apiVersion").unwrap_or_default();
    let kind = str_field(value, "kind").ok_or_else(|| "missing kind".to_string())?;
    if !matches!(
        (api_version, kind),
        ("v1", "Service")
            | ("v1", "Pod")
            | ("v1", "Node")
            | ("discovery.k8s.io/v1", "EndpointSlice")
    ) {
        tracing::debug!(
            api_version,
            kind,
            "manifests: skipping a kind the proxy does not use"
        );
        return Ok(());
    }
    push_typed(parse_typed(text, kind)?, snapshot)
}

/// Adds `typed` to its list in `snapshot`, in the namespace `default` when
/// it names none, trimmed as the Kubernetes source trims ([`crate::sources::kubernetes::trim`]:
/// `managedFields` and annotations the agent does not read, often most of an
/// object dumped with `kubectl get -o yaml`). A Service is validated first.
fn push_typed(typed: Typed, snapshot: &mut impl Sink) -> Result<(), String> {
    match typed {
        Typed::Service(mut svc) => {
            default_namespace(&mut svc.metadata);
            validate_service(&svc)?;
            crate::sources::kubernetes::trim(&mut *svc);
            snapshot.service(*svc);
        }
        Typed::Pod(mut pod) => {
            default_namespace(&mut pod.metadata);
            crate::sources::kubernetes::trim(&mut *pod);
            snapshot.pod(*pod);
        }
        Typed::Node(mut node) => {
            crate::sources::kubernetes::trim(&mut *node);
            snapshot.node(*node);
        }
        Typed::EndpointSlice(mut slice) => {
            default_namespace(&mut slice.metadata);
            crate::sources::kubernetes::trim(&mut *slice);
            snapshot.endpoint_slice(*slice);
        }
    }
    Ok(())
}

/// Loads `doc` if it is one JSON object of a kind the proxy uses (or skips
/// it if its kind is another) and valid; false leaves it to the YAML path.
fn load_json(doc: &str, snapshot: &mut impl Sink) -> bool {
    if !doc.trim_start().starts_with('{') {
        return false;
    }
    // Two passes over the text, neither building a tree: the first checks
    // that every object has each key once (a JSON object with a key twice
    // is the YAML path's to refuse: serde_json would keep the last one
    // silently) and reads `apiVersion` and `kind`; the second deserializes
    // the object of that kind straight from the text. Through a
    // `serde_json::Value` (built and then converted) the parse of 50,000
    // Services and their EndpointSlices took a third longer.
    let Ok(header) = serde_json::from_str::<JsonHeader>(doc) else {
        return false;
    };
    let (Some(api_version), Some(kind)) = (header.api_version, header.kind) else {
        return false;
    };
    let typed = match (&*api_version, &*kind) {
        ("v1", "Service") => serde_json::from_str(doc).map(|o| Typed::Service(Box::new(o))),
        ("v1", "Pod") => serde_json::from_str(doc).map(|o| Typed::Pod(Box::new(o))),
        ("v1", "Node") => serde_json::from_str(doc).map(|o| Typed::Node(Box::new(o))),
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            serde_json::from_str(doc).map(|o| Typed::EndpointSlice(Box::new(o)))
        }
        // Lists and errors are the YAML path's; other kinds are skipped there.
        _ => return false,
    };
    // An invalid Service is the YAML path's to report.
    typed.is_ok_and(|t| push_typed(t, snapshot).is_ok())
}

/// A JSON string, borrowed from the text when it has no escapes.
struct JsonStr<'de>(std::borrow::Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for JsonStr<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = JsonStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<JsonStr<'de>, E> {
                Ok(JsonStr(std::borrow::Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<JsonStr<'de>, E> {
                Ok(JsonStr(std::borrow::Cow::Owned(s.to_owned())))
            }
            fn visit_string<E>(self, s: String) -> Result<JsonStr<'de>, E> {
                Ok(JsonStr(std::borrow::Cow::Owned(s)))
            }
        }
        d.deserialize_str(Visitor)
    }
}

/// Refuses `keys` (one object's) if one is there twice.
fn check_unique_keys<E: serde::de::Error>(mut keys: Vec<JsonStr<'_>>) -> Result<(), E> {
    keys.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    if keys.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(E::custom("duplicate key"));
    }
    Ok(())
}

/// Any JSON value, walked and dropped: refused at an object, at any depth,
/// with a key twice.
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_i64<E>(self, _: i64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_u64<E>(self, _: u64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_f64<E>(self, _: f64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_str<E>(self, _: &str) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_none<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<UniqueKeys, D::Error> {
                serde::Deserialize::deserialize(d)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<UniqueKeys, A::Error> {
                while seq.next_element::<UniqueKeys>()?.is_some() {}
                Ok(UniqueKeys)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some(k) = map.next_key::<JsonStr>()? {
                    map.next_value::<UniqueKeys>()?;
                    keys.push(k);
                }
                check_unique_keys(keys)?;
                Ok(UniqueKeys)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A JSON object walked as [`UniqueKeys`] walks it, keeping its
/// `apiVersion` and `kind`; anything but an object, or either of them not
/// a string, is refused.
struct JsonHeader<'de> {
    api_version: Option<std::borrow::Cow<'de, str>>,
    kind: Option<std::borrow::Cow<'de, str>>,
}

impl<'de> serde::Deserialize<'de> for JsonHeader<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = JsonHeader<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<JsonHeader<'de>, A::Error> {
                let mut out = JsonHeader {
                    api_version: None,
                    kind: None,
                };
                let mut keys = Vec::new();
                while let Some(k) = map.next_key::<JsonStr>()? {
                    match &*k.0 {
                        "apiVersion" => out.api_version = Some(map.next_value::<JsonStr>()?.0),
                        "kind" => out.kind = Some(map.next_value::<JsonStr>()?.0),
                        _ => {
                            map.next_value::<UniqueKeys>()?;
                        }
                    }
                    keys.push(k);
                }
                check_unique_keys(keys)?;
                Ok(out)
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// One object of a kind the proxy uses.
enum Typed {
    Service(Box<Service>),
    Pod(Box<Pod>),
    Node(Box<Node>),
    EndpointSlice(Box<EndpointSlice>),
}

/// Deserializes `text` as the type of `kind`; errors carry the field path
/// (`spec.ports[0].port: invalid type: ...`).
fn parse_typed(text: &str, kind: &str) -> Result<Typed, String> {
    fn parse<T: DeserializeOwned>(text: &str) -> Result<Box<T>, String> {
        yaml_serde::from_str(text)
            .map(Box::new)
            .map_err(|e| strip_location(&e))
    }
    Ok(match kind {
        "Service" => Typed::Service(parse(text)?),
        "Pod" => Typed::Pod(parse(text)?),
        "Node" => Typed::Node(parse(text)?),
        _ => Typed::EndpointSlice(parse(text)?),
    })
}

fn default_namespace(meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
    if meta.namespace.as_deref().is_none_or(str::is_empty) {
        meta.namespace = Some("default".to_string());
    }
}

/// Checks the manifests source can use this Service as written.
fn validate_service(svc: &Service) -> Result<(), String> {
    let Some(spec) = &svc.spec else { return Ok(()) };
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    if !matches!(type_, "ClusterIP" | "NodePort" | "LoadBalancer") {
        return Ok(());
    }
    let has_selector = spec.selector.as_ref().is_some_and(|s| !s.is_empty());
    let has_ports = spec.ports.as_ref().is_some_and(|p| !p.is_empty());
    let has_cluster_ip = spec.cluster_ip.as_deref().is_some_and(|ip| !ip.is_empty())
        || spec
            .cluster_ips
            .as_ref()
            .is_some_and(|ips| ips.iter().any(|ip| !ip.is_empty()));
    if (has_selector || has_ports) && !has_cluster_ip {
        return Err(
            "has no spec.clusterIP (the manifests source does not allocate ClusterIPs)".into(),
        );
    }
    Ok(())
}

fn str_field<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

fn object_ref(value: &Value) -> ObjectRef {
    let meta = value.get("metadata");
    let kind = str_field(value, "kind").map(str::to_string);
    let name = meta.and_then(|m| str_field(m, "name")).map(str::to_string);
    let namespace = meta
        .and_then(|m| str_field(m, "namespace"))
        .map(str::to_string);
    let namespaced = !matches!(kind.as_deref(), Some("Node" | "List"));
    let namespace = match namespace {
        Some(ns) => Some(ns),
        None if namespaced && name.is_some() => Some("default".to_string()),
        None => None,
    };
    ObjectRef {
        kind,
        namespace,
        name,
    }
}

/// Splits a YAML stream into documents at `---` and `...` markers (which YAML
/// allows only at the start of a line, never inside content), so that one bad
/// document does not hide the others. Returns each document with the 0-based
/// line it starts at.
fn split_documents(text: &str) -> Vec<(usize, &str)> {
    fn is_marker(line: &str, marker: &str) -> bool {
        line.strip_prefix(marker)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    }
    let mut docs = Vec::new();
    let (mut start, mut start_line, mut offset) = (0usize, 0usize, 0usize);
    // A segment not opened by `---` (the file's start, or after `...`) is a
    // document only when it has content other than blanks and comments.
    let mut explicit = false;
    let mut seen_content = false;
    for (line_no, line) in text.split_inclusive('\n').enumerate() {
        let bare = line.trim_end_matches('\n');
        if is_marker(bare, "---") {
            if explicit || seen_content {
                docs.push((start_line, &text[start..offset]));
            }
            // The rest of the marker line may hold content (`--- {a: 1}`).
            (start, start_line, explicit, seen_content) = (offset + 3, line_no, true, false);
        } else if is_marker(bare, "...") {
            if explicit || seen_content {
                docs.push((start_line, &text[start..offset]));
            }
            (start, start_line, explicit, seen_content) =
                (offset + line.len(), line_no + 1, false, false);
        } else if !bare.trim().is_empty() && !bare.trim_start().starts_with('#') {
            seen_content = true;
        }
        offset += line.len();
    }
    if explicit || seen_content {
        docs.push((start_line, &text[start..]));
    }
    docs
}
