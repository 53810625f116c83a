//! A reader of the Prometheus text format, enough for `fallow stat --nbd` to read a
//! `/metrics` page: it keeps every sample (name, labels, value) and skips comments
//! (`# HELP`, `# TYPE`, and the `# EOF` that OpenMetrics text, which `prometheus-client`
//! writes, ends with). Timestamps and exemplars after the value are ignored.
//!
//! ```text
//!  fallow_nbd_cache_pages_read_total{export="d",tier="local"} 16
//!  └─ name ─────────────────┘└─ labels (escapes \\ \" \n) ─┘ └ value (float, +Inf, NaN)
//! ```
//!
//! The page comes from the network, so the parser is total: any input gives samples or a
//! [`ParseError`] naming the line, never a panic.

use std::fmt;
use std::iter::Peekable;
use std::str::Chars;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric name, with any `_total`, `_sum`, `_count` or `_bucket` suffix.
    pub name: String,
    /// The labels, in the order written.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// A line that is not a sample, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// The line, counted from 1.
    pub line: usize,
    /// What is wrong with it.
    pub why: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.why)
    }
}

impl std::error::Error for ParseError {}

/// Every sample of a metrics page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    samples: Vec<Sample>,
}

impl Metrics {
    /// Parses a whole page.
    pub fn parse(text: &str) -> Result<Metrics, ParseError> {
        let mut samples = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            samples.push(parse_sample(line).map_err(|why| ParseError { line: i + 1, why })?);
        }
        Ok(Metrics { samples })
    }

    /// Every sample, in page order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The samples named `name`.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The value of the first sample named `name` that has every label in `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.named(name)
            .find(|s| labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
            .map(|s| s.value)
    }
}

/// `name[{labels}] value [timestamp] [# exemplar]`, without the line's outer whitespace.
fn parse_sample(line: &str) -> Result<Sample, &'static str> {
    let mut chars = line.chars().peekable();
    let name = take_name(&mut chars, |c| c == ':');
    if name.is_empty() {
        return Err("no metric name");
    }
    let mut labels = Vec::new();
    if chars.peek() == Some(&'{') {
        chars.next();
        labels = parse_labels(&mut chars)?;
    }
    let rest: String = chars.collect();
    if !rest.starts_with([' ', '\t']) {
        return Err("no space before the value");
    }
    let value = rest.split_whitespace().next().ok_or("no value")?;
    let value = value.parse::<f64>().map_err(|_| "the value is not a number")?;
    Ok(Sample { name, labels, value })
}

/// The labels after `{`, up to and including `}`; a trailing comma is allowed.
fn parse_labels(chars: &mut Peekable<Chars<'_>>) -> Result<Vec<(String, String)>, &'static str> {
    let mut labels = Vec::new();
    loop {
        skip_spaces(chars);
        if chars.next_if_eq(&'}').is_some() {
            return Ok(labels);
        }
        let key = take_name(chars, |_| false);
        if key.is_empty() {
            return Err("a label has no name");
        }
        skip_spaces(chars);
        let equals = chars.next() == Some('=');
        skip_spaces(chars);
        if !equals || chars.next() != Some('"') {
            return Err("a label name is not followed by =\"");
        }
        labels.push((key, parse_label_value(chars)?));
        skip_spaces(chars);
        match chars.next() {
            Some(',') => {}
            Some('}') => return Ok(labels),
            _ => return Err("labels are not separated by commas or closed by }"),
        }
    }
}

/// A label value after its opening quote, up to and including the closing one.
fn parse_label_value(chars: &mut Peekable<Chars<'_>>) -> Result<String, &'static str> {
    let mut value = String::new();
    loop {
        match chars.next() {
            None => return Err("a label value is not closed"),
            Some('"') => return Ok(value),
            Some('\\') => match chars.next() {
                Some('n') => value.push('\n'),
                Some(c @ ('\\' | '"')) => value.push(c),
                _ => return Err("a label value has a bad escape"),
            },
            Some(c) => value.push(c),
        }
    }
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`, plus the characters `extra` allows (`:` in metric names).
fn take_name(chars: &mut Peekable<Chars<'_>>, extra: impl Fn(char) -> bool) -> String {
    let mut name = String::new();
    while let Some(&c) = chars.peek() {
        let ok = c.is_ascii_alphabetic()
            || c == '_'
            || extra(c)
            || (c.is_ascii_digit() && !name.is_empty());
        if !ok {
            break;
        }
        name.push(c);
        chars.next();
    }
    name
}

fn skip_spaces(chars: &mut Peekable<Chars<'_>>) {
    while chars.next_if(|c| *c == ' ' || *c == '\t').is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_prometheus_client_writes() {
        let text = "# HELP fallow_nbd_requests NBD requests answered.\n\
                    # TYPE fallow_nbd_requests counter\n\
                    fallow_nbd_requests_total{cmd=\"read\",result=\"ok\"} 12\n\
                    fallow_nbd_request_duration_seconds_bucket{cmd=\"read\",le=\"+Inf\"} 12\n\
                    fallow_nbd_backing_read_seconds_total{export=\"d\"} 0.0125\n\
                    fallow_nbd_connections 1\n\
                    # EOF\n";
        let m = Metrics::parse(text).unwrap();
        assert_eq!(m.samples().len(), 4);
        assert_eq!(
            m.get("fallow_nbd_requests_total", &[("cmd", "read"), ("result", "ok")]),
            Some(12.0)
        );
        assert_eq!(m.get("fallow_nbd_requests_total", &[("cmd", "write")]), None);
        assert_eq!(
            m.get("fallow_nbd_backing_read_seconds_total", &[("export", "d")]),
            Some(0.0125)
        );
        assert_eq!(m.get("fallow_nbd_connections", &[]), Some(1.0));
        let bucket = m.named("fallow_nbd_request_duration_seconds_bucket").next().unwrap();
        assert_eq!(bucket.label("le"), Some("+Inf"));
    }

    #[test]
    fn escapes_spaces_timestamps_and_special_values() {
        let text = "m{a=\"x\\\"y\\\\z\\n\" , b = \"é, }\",} +Inf 1700000000000\r\n\
                    n NaN\n\
                    o:sub -1.5e3 # {trace=\"1\"} 1\n";
        let m = Metrics::parse(text).unwrap();
        let s = &m.samples()[0];
        assert_eq!(s.label("a"), Some("x\"y\\z\n"));
        assert_eq!(s.label("b"), Some("é, }"));
        assert_eq!(s.value, f64::INFINITY);
        assert!(m.get("n", &[]).unwrap().is_nan());
        assert_eq!(m.get("o:sub", &[]), Some(-1500.0));
    }

    #[test]
    fn bad_lines_are_errors_with_their_number() {
        let cases = [
            ("{a=\"1\"} 1", "no metric name"),
            ("m{a=\"1\" 1", "labels are not separated by commas or closed by }"),
            ("m{a=1} 1", "a label name is not followed by =\""),
            ("m{a=\"1} 1", "a label value is not closed"),
            ("m{a=\"\\x\"} 1", "a label value has a bad escape"),
            ("m{=\"1\"} 1", "a label has no name"),
            ("m", "no space before the value"),
            ("m{}1", "no space before the value"),
            ("m one", "the value is not a number"),
            ("<html>", "no metric name"),
        ];
        for (line, why) in cases {
            let text = format!("# TYPE m gauge\nok 1\n{line}\n");
            assert_eq!(Metrics::parse(&text), Err(ParseError { line: 3, why }), "{line:?}");
        }
    }

    #[test]
    fn never_panics_on_cut_input() {
        let text = "a_b{x=\"1\\\\\",y=\"é\"} 2.5 123\n";
        for cut in text.char_indices().map(|(i, _)| i) {
            let _ = Metrics::parse(&text[..cut]);
        }
    }
}
