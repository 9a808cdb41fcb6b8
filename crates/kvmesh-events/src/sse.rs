//! Server-sent events as the engines stream completions (`stream: true`): vLLM and SGLang send
//! one `data: {json}` event per token chunk and end with `data: [DONE]`.
//!
//! [`SseReader`] parses the stream incrementally as the WHATWG HTML standard's "event stream"
//! interpretation does: lines end with CRLF, LF or CR; a blank line ends an event; `data`
//! fields are joined with `\n` (one space after the colon dropped); lines starting with `:`
//! are comments; other fields are ignored apart from `event`. Bytes are buffered until an event
//! is whole, so a UTF-8 character split across network chunks is decoded whole, and `data: `
//! inside a token's text is text, not an event.

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// Its `event` field (the event type), when sent.
    pub event: Option<String>,
    /// Its `data` lines joined with `\n` (invalid UTF-8 replaced by U+FFFD).
    pub data: String,
}

impl SseEvent {
    /// The OpenAI stream's end marker, `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data == "[DONE]"
    }
}

/// An incremental SSE parser: [`SseReader::push`] bytes as they arrive, take whole events with
/// [`SseReader::next_event`], and (to pass the stream through unchanged) the raw bytes of the
/// events taken with [`SseReader::take_parsed`].
#[derive(Debug, Default)]
pub struct SseReader {
    buf: Vec<u8>,
    /// Bytes of `buf` parsed into lines so far.
    pos: usize,
    /// Bytes of `buf` that end the last event dispatched (everything before is whole events).
    parsed: usize,
    data: String,
    has_data: bool,
    event: Option<String>,
}

impl SseReader {
    /// An empty reader.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `bytes` of the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole event, if the bytes pushed so far complete one. Blank-line runs that
    /// end no data (comments, keep-alives) are consumed without an event.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        while let Some((line, next)) = self.next_line() {
            let line = self.buf[self.pos..line].to_vec();
            self.pos = next;
            if line.is_empty() {
                self.parsed = self.pos;
                let (data, has_data, event) =
                    (std::mem::take(&mut self.data), std::mem::take(&mut self.has_data), self.event.take());
                if has_data {
                    // The data buffer's last `\n` is not part of the data.
                    let data = data.strip_suffix('\n').map(str::to_string).unwrap_or(data);
                    return Some(SseEvent { event, data });
                }
                continue;
            }
            self.field(&line);
        }
        None
    }

    /// The raw bytes of every event taken so far (and of the comments and blank lines between
    /// them), in order; what is left holds only the event still incomplete.
    pub fn take_parsed(&mut self) -> Vec<u8> {
        let rest = self.buf.split_off(self.parsed);
        let parsed = std::mem::replace(&mut self.buf, rest);
        self.pos -= self.parsed;
        self.parsed = 0;
        parsed
    }

    /// Every byte pushed and not yet taken (an incomplete event's, at the end of a stream).
    pub fn into_buffered(self) -> Vec<u8> {
        self.buf
    }

    /// Bytes pushed and not yet taken by [`Self::take_parsed`].
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The end of the next whole line after `pos` and where the line after it starts. A CR at
    /// the end of the buffer waits for the next byte (it may be a CRLF's first half).
    fn next_line(&self) -> Option<(usize, usize)> {
        let rest = &self.buf[self.pos..];
        let i = rest.iter().position(|&b| b == b'\n' || b == b'\r')?;
        let end = self.pos + i;
        match rest[i] {
            b'\n' => Some((end, end + 1)),
            _ => match rest.get(i + 1) {
                Some(b'\n') => Some((end, end + 2)),
                Some(_) => Some((end, end + 1)),
                None => None,
            },
        }
    }

    fn field(&mut self, line: &[u8]) {
        if line.first() == Some(&b':') {
            return;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match name {
            b"data" => {
                self.data.push_str(&String::from_utf8_lossy(value));
                self.data.push('\n');
                self.has_data = true;
            }
            b"event" => self.event = Some(String::from_utf8_lossy(value).into_owned()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&[u8]]) -> (Vec<SseEvent>, Vec<u8>, usize) {
        let mut r = SseReader::new();
        let (mut out, mut passed) = (Vec::new(), Vec::new());
        for c in chunks {
            r.push(c);
            while let Some(e) = r.next_event() {
                out.push(e);
            }
            passed.extend(r.take_parsed());
        }
        (out, passed, r.buffered())
    }

    fn data(e: &[SseEvent]) -> Vec<&str> {
        e.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn data_inside_token_text_is_text() {
        let (e, ..) = events(&[b"data: {\"text\":\"data: [DONE]\"}\n\ndata: [DONE]\n\n"]);
        assert_eq!(data(&e), vec!["{\"text\":\"data: [DONE]\"}", "[DONE]"]);
        assert!(!e[0].is_done() && e[1].is_done());
    }

    #[test]
    fn a_character_split_across_chunks_is_decoded_whole() {
        let text = "data: {\"text\":\"é\"}\n\n".as_bytes();
        let cut = text.iter().position(|&b| b == 0xC3).unwrap() + 1;
        let (e, passed, left) = events(&[&text[..cut], &text[cut..]]);
        assert_eq!(data(&e), vec!["{\"text\":\"é\"}"]);
        assert_eq!((passed.as_slice(), left), (text, 0));
    }

    #[test]
    fn line_endings_comments_fields_and_multi_line_data() {
        let (e, passed, left) =
            events(&[b": keep-alive\r\n\r\nevent: delta\r\ndata: a\r", b"\ndata:b\rid: 7\r\r", b"data: half"]);
        assert_eq!(e, vec![SseEvent { event: Some("delta".into()), data: "a\nb".into() }]);
        // The incomplete event stays buffered, and only whole events are passed on.
        assert_eq!(left, b"data: half".len());
        assert_eq!(passed, b": keep-alive\r\n\r\nevent: delta\r\ndata: a\r\ndata:b\rid: 7\r\r".to_vec());
    }

    #[test]
    fn a_cr_at_the_end_of_a_chunk_waits_for_its_lf() {
        // Were the CR taken as a line end, the LF after it would end the event early.
        let (e, ..) = events(&[b"data: x\r", b"\ndata: y\r\n\r\n"]);
        assert_eq!(data(&e), vec!["x\ny"]);
    }
}
