package guard

import (
	"errors"
	"io"
	"net/http"
)

// HTTP returns next wrapped so that a panic while serving one request is
// recovered, logged and counted under where. If no response had been
// started, respond writes the error answer (nil: a plain 500), so the
// client gets an error for that request and the connection stays usable.
// If the response had started (a GET streaming its body, say), a 500
// cannot be sent any more and appending to the body would hand the
// client a wrong answer, so the guard aborts the connection instead
// (panic(http.ErrAbortHandler), which net/http handles quietly): the
// client sees a truncated response.
//
// A panic with http.ErrAbortHandler from next passes through uncounted:
// it is net/http's way of aborting a response on purpose.
func (g *Guard) HTTP(where string, next http.Handler, respond func(w http.ResponseWriter, r *http.Request, err *PanicError)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tw := &trackingWriter{ResponseWriter: w}
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if err, ok := v.(error); ok && errors.Is(err, http.ErrAbortHandler) {
				panic(v)
			}
			pe := g.handle(where, v)
			if tw.started {
				panic(http.ErrAbortHandler)
			}
			if respond == nil {
				http.Error(w, "internal error (recovered; see the server log)", http.StatusInternalServerError)
				return
			}
			respond(w, r, pe)
		}()
		next.ServeHTTP(tw, r)
	})
}

// trackingWriter notes whether the response has started. It keeps the
// optional interfaces handlers use on the hot path (Flush, ReadFrom) and
// lets http.ResponseController reach the rest through Unwrap.
type trackingWriter struct {
	http.ResponseWriter
	started bool
}

func (w *trackingWriter) WriteHeader(code int) {
	if code >= 200 || code == http.StatusSwitchingProtocols {
		w.started = true
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *trackingWriter) Write(p []byte) (int, error) {
	w.started = true
	return w.ResponseWriter.Write(p)
}

func (w *trackingWriter) ReadFrom(r io.Reader) (int64, error) {
	w.started = true
	if rf, ok := w.ResponseWriter.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(struct{ io.Writer }{w.ResponseWriter}, r)
}

func (w *trackingWriter) Flush() {
	w.started = true
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *trackingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
